"""Corpus -> tokenizer -> packed data set -> per-rank micro batches; the batch arithmetic."""

from ddptrain.data.batch import BatchPlan
from ddptrain.data.corpus import validate_source
from ddptrain.data.dataset import TokenData, build_token_data
from ddptrain.data.loader import MicroBatches, eval_batches

__all__ = ["BatchPlan", "MicroBatches", "TokenData", "build_token_data", "eval_batches", "validate_source"]
