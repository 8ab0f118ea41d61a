from ddptrain.app.ckpt import main

main()
