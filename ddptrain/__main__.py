from ddptrain.cli import main

main()
