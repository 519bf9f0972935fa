"""The hypothesis profiles: the ``large`` property tests run their full count only on request."""

import pytest
from hypothesis import settings

from tests.profiles import examples


@pytest.fixture
def restore_profile():
    before = settings.get_current_profile_name()
    yield
    settings.load_profile(before)


def test_examples_follow_the_loaded_profile(restore_profile):
    settings.load_profile("large")
    assert examples(300, ci=60) == 300
    # what --hypothesis-verbosity derives from the loaded profile keeps the full count
    settings.register_profile("large-with-verbose-verbosity", parent=settings.get_profile("large"))
    settings.load_profile("large-with-verbose-verbosity")
    assert examples(300, ci=60) == 300
    settings.load_profile("ci")
    assert examples(300, ci=60) == 60


@pytest.mark.parametrize(("full", "ci"), [(10, 0), (10, 11), (0, 0)])
def test_examples_needs_a_positive_ci_count_within_the_full_one(full, ci):
    with pytest.raises(ValueError, match="need 0 < ci <= full"):
        examples(full, ci=ci)
