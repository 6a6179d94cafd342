"""N-gram prompt lookup's choice among a phrase's occurrences (daemon/engine/spec_ngram.py)."""

from cpud.engine.spec_ngram import NgramIndex


def test_without_an_earlier_match_the_latest_occurrence_wins():
    index = NgramIndex(2, 2)
    assert index.propose([2, 3, 5, 2, 3, 6, 2, 3], 1) == [6]


def test_the_occurrence_ahead_of_where_the_last_match_reached_wins():
    document = [5, 6, 7, 8, 1, 2, 3, 4, 1, 2, 9]
    index = NgramIndex(2, 2)
    tokens = [*document, 5, 6]
    assert index.propose(tokens, 2) == [7, 8]  # copied from position 2
    tokens += [7, 0, 1, 2]  # 7 accepted, then other text: the source reached position 6
    # [1, 2] occurred before 3 4 (at 6) and before 9 (latest): the one at 6 is ahead
    assert index.propose(tokens, 2) == [3, 4]
