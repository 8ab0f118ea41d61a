"""The analytic plan: batch split, model state per ZeRO stage and communication per step, by arithmetic."""
