from ddptrain.checkpoint.tool import main

main()
