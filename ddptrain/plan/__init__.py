"""The calibrated what-if predictor: a measured run's step carried to other world sizes, layouts and links."""

from ddptrain.plan.calibration import Calibration
from ddptrain.plan.layout import Layout, allreduce_seconds
from ddptrain.plan.overlap import SyncTimeline, sync_timeline
from ddptrain.plan.prediction_render import render_prediction, what_if
from ddptrain.plan.predictor import Prediction, predict

__all__ = ["Calibration", "Layout", "Prediction", "SyncTimeline", "allreduce_seconds", "predict",
           "render_prediction", "sync_timeline", "what_if"]
