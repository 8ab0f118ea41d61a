"""What the tests share: running the CLI, forked gloo ranks, training runs in-process, tiny models, probes."""
