"""N-gram prompt lookup's choice of occurrence and proposal length
(daemon/engine/spec_ngram.py)."""

from cpud.engine.spec_ngram import NgramIndex


def test_a_fresh_match_proposes_one_token_and_its_continuation_up_to_k():
    index = NgramIndex(2, 2)
    tokens = [2, 3, 5, 2, 3, 6, 7, 8, 9, 2, 3]
    assert index.propose(tokens, 4) == [6]  # no earlier match: the latest occurrence
    tokens += [6, 7]  # accepted, and the target's own token is the source's next
    assert index.propose(tokens, 4) == [8, 9, 2, 3]
    tokens += [8, 1]  # rejected at 9
    assert index.propose(tokens, 4) == []  # [8, 1] never occurred
    tokens += [5, 2, 3]  # [2, 3] again, but not where the source had reached: fresh
    assert index.propose(tokens, 4) == [6]


def test_the_occurrence_ahead_of_where_the_last_match_reached_wins():
    document = [5, 6, 7, 8, 0, 1, 2, 3, 4, 1, 2, 9]
    index = NgramIndex(2, 2)
    tokens = [*document, 5, 6]
    assert index.propose(tokens, 2) == [7]  # copied from position 2
    tokens += [7, 1, 2]  # 7 accepted, then other text: the source reached position 5
    # [1, 2] occurred before 3 (at 7) and before 9 (latest): the one at 7 is ahead
    assert index.propose(tokens, 2) == [3]
