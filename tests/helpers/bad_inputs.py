"""Bad inputs checked under torchrun with 2 ranks (``test_cli.py``), each with the one-line error every rank prints;
``test_bad_inputs.py`` checks that the README's bad-input table lists each of them."""

UNDER_TORCHRUN = [
    (["optim.lrr=1"], "optim.lrr: Key 'lrr' not in 'OptimConfig'"),
    (["train.steps=abc"], "train.steps: Value 'abc' of type 'str' could not be converted to Integer"),
    (["data.global_batch_size=10", "data.micro_batch_size=4"],
     "data.global_batch_size=10 is not divisible by data.micro_batch_size=4 x dp=2 = 8"),
    (["data=files", "data.paths=[/nonexistent/corpus.txt]"], "data.paths: /nonexistent/corpus.txt: no such file"),
    (["model=gpt5"], "Could not find 'model/gpt5'; available: gpt2_small, llama_1b, llama_tiny"),
    (["data=hub", "data.name=nobody/no-such-dataset"], "data.name=nobody/no-such-dataset: cannot load the hub"),
]
