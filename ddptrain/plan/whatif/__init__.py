"""The calibrated what-if predictor: a measured run's step carried to other world sizes, layouts and links."""

from ddptrain.plan.whatif.calibration import Calibration
from ddptrain.plan.whatif.layout import Layout, allreduce_seconds
from ddptrain.plan.whatif.overlap import SyncTimeline, sync_timeline
from ddptrain.plan.whatif.predictor import Prediction, predict
from ddptrain.plan.whatif.render import render_prediction, what_if

__all__ = ["Calibration", "Layout", "Prediction", "SyncTimeline", "allreduce_seconds", "predict",
           "render_prediction", "sync_timeline", "what_if"]
