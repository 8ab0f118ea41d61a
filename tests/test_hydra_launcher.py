"""``hydra/launcher=ddptrain`` against Hydra's own launcher conformance suites, parametrized as Hydra's plugins
parametrize them (its basic launcher, joblib, submitit): the launcher suite runs sweeps in this process through
Hydra's sweep runner; the integration suite runs a small Hydra app as a script with ``-m`` and our launcher chosen
in its config (job names, sweep dirs, ``override_dirname``, ``chdir``, ``get_original_cwd``, ``to_absolute_path``).
"""

from __future__ import annotations

import pytest
from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher
from hydra.test_utils.launcher_common_tests import IntegrationTestSuite, LauncherTestSuite
from hydra.version import VersionBase
from packaging.version import Version


@pytest.fixture(autouse=True)
def hydras_own_defaults(hydra_restore_singletons: None) -> None:
    """Hydra's suites run as in Hydra's own test sessions: with no ``version_base`` given, so Hydra 1.1's defaults
    (a job runs in its own directory, where its log is). Hydra keeps the version base process-wide: an earlier test
    of this session that composed ddptrain's config (``version_base="1.3"``: jobs stay in the working directory)
    would otherwise decide it for them. Hydra's own fixture puts every singleton back afterwards."""
    VersionBase.instance().setbase(Version("1.1"))  # what an unspecified version_base resolves to


def test_hydra_discovers_the_ddptrain_launcher() -> None:
    assert "DdptrainLauncher" in [c.__name__ for c in Plugins.instance().discover(Launcher)]


@pytest.mark.parametrize(("launcher_name", "overrides"), [("ddptrain", [])])
class TestDdptrainLauncher(LauncherTestSuite):
    """Hydra's launcher suite: one and two jobs, hydra overrides not swept, strict keys, a mandatory default
    left unset, resolvers; each job's directory as Hydra's launchers leave it (``.hydra/`` and the job log)."""


@pytest.mark.parametrize(("task_launcher_cfg", "extra_flags"),
                         [({"defaults": [{"override hydra/launcher": "ddptrain"}]}, ["-m"])])
class TestDdptrainLauncherIntegration(IntegrationTestSuite):
    """Hydra's integration suite: a Hydra app (a script run in its own process, which finds our launcher through
    Hydra's plugin scan of this environment's install) whose config picks our launcher. Ten processes of about
    0.4 s each on a quiet machine (no torch): the fast tier."""
