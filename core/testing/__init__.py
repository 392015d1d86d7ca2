"""mlxchat.testing: the conformance kit a plugin's tests run (as pytest's ``pytester`` is pytest's).

- :func:`assert_parity` checks the model loaded from a fixture folder against the oracle's outputs stored
  there: logits, chunked prefill, cached decoding, greedy tokens.
- :class:`SessionContract` is a test class of the session invariants; subclass it and name a fixture.
- :mod:`mlxchat.testing.builders` makes fixture folders from transformers classes (at build time only:
  torch and transformers are needed then, not when tests run).

Installing mlxchat registers the pytest plugin :mod:`mlxchat.testing.pytest_plugin` (entry point
``pytest11``), which provides the ``mlxchat_fixture`` fixture and closes fixture models after the run.
"""

from .fixtures import architecture_of, close_fixtures, fixture_folders, fixture_info, load_fixture
from .parity import (
    CHUNKINGS,
    TOLERANCE,
    assert_close,
    assert_parity,
    batched_decoding_problems,
    chunked_logits,
    full_logits,
    greedy_tokens,
    prefill_and_decode,
    reference,
)
from .sessions import (
    GREEDY,
    SessionContract,
    assert_matches_stateless,
    expected_reuse,
    prompt_ids,
    send_checked,
    stateless_tokens,
)

__all__ = [
    "CHUNKINGS",
    "GREEDY",
    "TOLERANCE",
    "SessionContract",
    "architecture_of",
    "assert_close",
    "assert_matches_stateless",
    "assert_parity",
    "batched_decoding_problems",
    "chunked_logits",
    "close_fixtures",
    "expected_reuse",
    "fixture_folders",
    "fixture_info",
    "full_logits",
    "greedy_tokens",
    "load_fixture",
    "prefill_and_decode",
    "prompt_ids",
    "reference",
    "send_checked",
    "stateless_tokens",
]
