"""Logprobs in the response shapes: OpenAI's legacy completions and chat formats, and vLLM's
prompt_logprobs (one entry per prompt token, null for the first)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cpud.engine.outputs import CompletionOutput, Logprob

LOGPROB_FLOOR = -9999.0  # what -inf becomes in JSON, as OpenAI and vLLM send it

PromptLogprobs = Sequence[dict[int, Logprob] | None]


def clamped(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def ranked(entry: dict[int, Logprob], limit: int) -> list[tuple[int, Logprob]]:
    items = sorted(entry.items(), key=lambda kv: kv[1].rank or 1 << 30)
    return [(t, lp) for t, lp in items if (lp.rank or 1 << 30) <= limit]


def legacy_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[dict[int, Logprob] | None],
    text_offset: int,
    top: int,
    decode: Callable[[int], str] | None = None,
) -> dict:
    """The legacy completions shape over token_ids; an entry of None (the prompt's first token)
    gives null logprobs and its text from `decode`."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = text_offset
    for token_id, entry in zip(token_ids, entries):
        if entry is None:
            text = decode(token_id) if decode else ""
            tokens.append(text)
            values.append(None)
            tops.append(None)
        else:
            chosen = entry[token_id]
            text = chosen.decoded_token or ""
            tokens.append(text)
            values.append(clamped(chosen.logprob))
            # the legacy format lists the sampled token among the top ones, as OpenAI does
            best = {lp.decoded_token or "": clamped(lp.logprob) for _, lp in ranked(entry, top)}
            best.setdefault(text, clamped(chosen.logprob))
            tops.append(best)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def completion_logprobs(out: CompletionOutput, start: int, text_offset: int, top: int) -> dict:
    return legacy_logprobs(out.token_ids[start:], (out.logprobs or [])[start:], text_offset, top)


def joined(first: dict, second: dict) -> dict:
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(out: CompletionOutput, start: int, top: int) -> dict:
    def item(lp: Logprob) -> dict:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": clamped(lp.logprob), "bytes": list(text.encode())}

    content = []
    for token_id, entry in zip(out.token_ids[start:], (out.logprobs or [])[start:]):
        row = item(entry[token_id])
        row["top_logprobs"] = [item(lp) for _, lp in ranked(entry, top)]
        content.append(row)
    return {"content": content}


def prompt_logprobs_json(entries: PromptLogprobs | None) -> list[dict | None] | None:
    """vLLM's prompt_logprobs: per prompt token, null or {token id: {logprob, rank,
    decoded_token}} holding the prompt token and its top alternatives."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            str(token): {
                "logprob": clamped(lp.logprob),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for token, lp in entry.items()
        }
        for entry in entries
    ]
