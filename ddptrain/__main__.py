if __name__ == "__main__":  # tokenizer workers are spawned and import this module again: no second run there
    from ddptrain.app.cli import main

    main()
