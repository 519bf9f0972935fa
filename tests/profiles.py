"""Hypothesis profiles: "ci" (the default, what ``make test`` runs) and "large".

The slowest property tests (random operation sequences over the cache, the waiting queue, long
scheduler traces) take their example count from :func:`examples` and carry the ``large`` marker.
Under "ci" they run a fraction of their examples, so the suite stays fast on a 2-core machine;
under "large" they run all of them:

    pytest -m large --hypothesis-profile=large tests      # or HYPOTHESIS_PROFILE=large
"""

from __future__ import annotations

import os

from hypothesis import settings

PROFILES = ("ci", "large")

for _name in PROFILES:
    # print_blob: a CI failure prints the blob that replays it (@reproduce_failure)
    settings.register_profile(_name, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def examples(full: int, ci: int) -> int:
    """``full`` examples under the "large" profile, ``ci`` under any other."""
    if not 0 < ci <= full:
        raise ValueError(f"need 0 < ci <= full, got ci={ci}, full={full}")
    # pytest's --hypothesis-profile loads the profile before test modules are imported; options
    # such as --hypothesis-verbosity derive "large-with-..." from it
    name = settings.get_current_profile_name()
    return full if name == "large" or name.startswith("large-with-") else ci
