"""The calibrated what-if predictor: a measured run's step carried to other world sizes, layouts and links."""

from ddptrain.predict.calibration import Calibration
from ddptrain.predict.layout import Layout, allreduce_seconds
from ddptrain.predict.model import Prediction, predict
from ddptrain.predict.overlap import SyncTimeline, sync_timeline
from ddptrain.predict.render import render_prediction, what_if

__all__ = ["Calibration", "Layout", "Prediction", "SyncTimeline", "allreduce_seconds", "predict",
           "render_prediction", "sync_timeline", "what_if"]
