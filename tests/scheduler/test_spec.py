import dataclasses

import pytest

from flashdec.scheduler import RequestSpec, SchedulerConfig


def test_request_spec_is_frozen_and_value_equal():
    a = RequestSpec("r1", 64, 128, submission_order=0)
    b = RequestSpec("r1", 64, 128, submission_order=0, prefix_id=None)
    assert a == b and hash(a) == hash(b)
    assert a != RequestSpec("r1", 64, 128, submission_order=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.max_new_tokens = 3  # type: ignore[misc]
    assert a.total_tokens == 192
    assert a.lifetime_blocks(32) == 6
    assert RequestSpec(7, 0, 1, 0, prefix_id=3).lifetime_blocks(16) == 1


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"request_id": True}, TypeError),
        ({"request_id": 1.5}, TypeError),
        ({"request_id": None}, TypeError),
        ({"initial_context_tokens": -1}, ValueError),
        ({"initial_context_tokens": 2.0}, TypeError),
        ({"max_new_tokens": 0}, ValueError),
        ({"max_new_tokens": True}, TypeError),
        ({"submission_order": -3}, ValueError),
        ({"submission_order": "0"}, TypeError),
        ({"prefix_id": False}, TypeError),
        ({"prefix_id": ("p",)}, TypeError),
    ],
)
def test_request_spec_validation(kwargs, error):
    args = {"request_id": "r", "initial_context_tokens": 4, "max_new_tokens": 2}
    args["submission_order"] = 0
    args.update(kwargs)
    with pytest.raises(error):
        RequestSpec(**args)


def test_scheduler_config_defaults_frozen_equal():
    c = SchedulerConfig(4, 2)
    assert (c.reserve_blocks, c.aging_threshold) == (0, 8)
    assert c == SchedulerConfig(max_active_requests=4, max_batch_size=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.reserve_blocks = 1  # type: ignore[misc]
    assert SchedulerConfig(1, 1, aging_threshold=None).aging_threshold is None
    assert SchedulerConfig(1, 1, aging_threshold=0).aging_threshold == 0


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"max_active_requests": 0}, ValueError),
        ({"max_active_requests": 1.0}, TypeError),
        ({"max_batch_size": 0}, ValueError),
        ({"max_batch_size": True}, TypeError),
        ({"reserve_blocks": -1}, ValueError),
        ({"aging_threshold": -1}, ValueError),
        ({"aging_threshold": "8"}, TypeError),
    ],
)
def test_scheduler_config_validation(kwargs, error):
    args = {"max_active_requests": 2, "max_batch_size": 2, **kwargs}
    with pytest.raises(error):
        SchedulerConfig(**args)
