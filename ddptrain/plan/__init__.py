"""Planning a run before it runs, by question: ``analytic`` (model state, batch and communication by arithmetic),
``memory`` (the peak of one step traced on fake tensors), ``whatif`` (a measured run's step carried to other
world sizes, layouts and links); ``dry_run`` combines them into what ``launch.dry_run=true`` prints."""
