"""Properties of the whole engine under the lifetime scheduler, on random specs and pools."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashdec.workloads import run_synthetic_workload


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_requests=st.integers(1, 8),
    num_blocks=st.integers(2, 24),
    block_size=st.sampled_from([1, 2, 4]),
    max_context=st.integers(0, 12),
    max_new=st.integers(1, 10),
    max_batch=st.integers(1, 4),
    max_active=st.integers(1, 6),
    arrivals=st.sampled_from([0.3, 1.0, 5.0]),
    seed=st.integers(0, 2**16),
)
def test_every_admitted_request_completes_and_the_pool_drains(
    num_requests,
    num_blocks,
    block_size,
    max_context,
    max_new,
    max_batch,
    max_active,
    arrivals,
    seed,
):
    result = run_synthetic_workload(
        num_requests=num_requests,
        num_blocks=num_blocks,
        block_size=block_size,
        min_context=0,
        max_context=max_context,
        min_new_tokens=1,
        max_new_tokens=max_new,
        max_batch_size=max_batch,
        max_active_requests=max_active,
        arrivals_per_step=arrivals,
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=4,
        seed=seed,
        max_steps=2000,
    )
    # nobody is left waiting or stuck: every request finished or was rejected as never fitting
    assert result.finished + result.rejected == num_requests
    lifetime = -(-(max_context + max_new) // block_size)
    if lifetime <= num_blocks:
        assert result.rejected == 0  # anything that fits an empty pool is eventually admitted
    assert result.final_used_blocks == 0
    assert result.peak_used_blocks <= num_blocks
    assert all(r.batch <= max_batch for r in result.trajectory)
    assert all(r.active <= max_active for r in result.trajectory)
