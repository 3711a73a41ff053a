"""Execution-horizon policies (Kairos 3.1), pure: no model involved."""

from __future__ import annotations

import numpy as np
import pytest

from lerobot_zenoh.errors import ConfigError
from lerobot_zenoh.scheduling.horizon import DiffusionConfidenceHorizon, StaticHorizon, converged_actions


def test_static_horizon_is_capped_by_the_chunk():
    assert StaticHorizon(10).horizon(50) == 10
    assert StaticHorizon(80).horizon(50) == 50


def kairos_fig7_updates():
    """6 actions, 3 steps. A5's final update is 1.5x its earlier mean; A6 is settled again."""
    earlier = np.ones((2, 6))
    final = np.array([[0.2, 0.5, 0.9, 1.3, 1.5, 0.1]])
    return np.vstack([earlier, final])


def test_confidence_horizon_stops_at_the_first_unconverged_action():
    updates = kairos_fig7_updates()
    assert converged_actions(updates, 0.4).tolist() == [True, True, True, True, False, True]
    assert DiffusionConfidenceHorizon(threshold=0.4).horizon(6, updates) == 4  # A6 is dropped too
    assert DiffusionConfidenceHorizon(threshold=0.6).horizon(6, updates) == 6
    assert DiffusionConfidenceHorizon(threshold=0.2).horizon(6, updates) == 3  # A4 at 1.3x fails 1.2x


def test_confidence_horizon_respects_h_min_and_vector_updates():
    updates = kairos_fig7_updates()
    assert DiffusionConfidenceHorizon(threshold=0.0, h_min=5).horizon(6, updates) == 5
    vectors = np.stack([updates, np.zeros_like(updates)], axis=-1)  # (steps, actions, 2): same norms
    assert DiffusionConfidenceHorizon(threshold=0.4).horizon(6, vectors) == 4


def test_without_updates_or_with_one_step_the_whole_chunk_is_trusted():
    assert DiffusionConfidenceHorizon().horizon(8) == 8
    assert DiffusionConfidenceHorizon().horizon(3, np.ones((1, 3))) == 3


@pytest.mark.parametrize("make", [lambda: StaticHorizon(0), lambda: DiffusionConfidenceHorizon(threshold=-1),
                                  lambda: DiffusionConfidenceHorizon(h_min=0)])
def test_bad_settings_raise_config_error(make):
    with pytest.raises(ConfigError):
        make()
