"""The multi-turn loop on the real SmolLM2 policy with the real HF engine and retrieval server."""

from __future__ import annotations

import pytest
from test_rollout_hf import RECORDS, RecordingEngine, check_engine_view, check_logprobs

from actors.config import RolloutConfig
from actors.engines.hf import HFEngine
from actors.reward import MALFORMED_REASONS
from actors.rollout import RolloutWorker

pytestmark = pytest.mark.integration


@pytest.mark.slow
def test_smollm2_multi_turn_rollout(model_dir, retrieval_server_url):
    """Real policy, real engine, real server: accounting and behaviour log-probs stay aligned."""
    cfg = RolloutConfig(
        group_size=4, max_turns=3, max_new_tokens_per_turn=64, max_response_tokens=512
    )
    engine = RecordingEngine(HFEngine(model_dir, seed=0))
    worker = RolloutWorker(str(model_dir), cfg, retrieval_server_url, seed=0, engine=engine)
    trajs = worker.rollout(RECORDS)
    model = engine.inner.model
    for t in trajs:
        check_engine_view(t, engine.inputs)
        # bf16: a per-trajectory mean gap of up to 0.06 measured on AVX2, 0.0605 on an
        # AVX-512-bf16 CPU (other kernels); the bound must hold on both
        check_logprobs(t, model, mean_atol=0.1, max_atol=0.4)
        assert t.malformed_reason in (None, *MALFORMED_REASONS)
        assert t.reward == float(t.success)
    # The untuned 135M policy answers directly (finish "eos"); it only learns the tool
    # format after the SFT warm start, so no search count is asserted here.
    assert {t.finish_reason for t in trajs} <= {"answer", "eos", "max_tokens", "max_turns"}
