"""vLLM's extension fields that change the prompt or the answer: continue_final_message (the
final message stays open for the model to continue it), echo on chat (the answer starts with
that final message), truncate_prompt_tokens (the prompt's last k tokens)."""

from __future__ import annotations

from cpud.engine.embedding import truncated
from cpud.frontend.errors import bad_request
from cpud.frontend.schemas import ChatMessage


def check_continue(continue_final: bool, add_generation_prompt: bool) -> None:
    """vLLM refuses both at once: a turn cannot be continued and a new one opened."""
    if continue_final and add_generation_prompt:
        raise bad_request(
            "continue_final_message and add_generation_prompt cannot both be true: send "
            "add_generation_prompt false to continue the final message",
            param="continue_final_message",
        )


def open_final_message(rendered: str, messages: list[dict]) -> str:
    """The rendered conversation cut right after the final message's text, so the model
    continues that message instead of reading it closed (transformers' continue_final_message:
    the last occurrence of the text, its leading and trailing spaces as the template kept
    them)."""
    final = messages[-1].get("content") or ""
    if not final.strip():
        raise bad_request(
            "continue_final_message needs a final message with text to continue",
            param="continue_final_message",
        )
    at = rendered.rfind(final.strip())
    if at < 0:
        raise bad_request(
            "continue_final_message: the chat template does not render the final message's "
            "text as it is, so it cannot be continued",
            param="continue_final_message",
        )
    kept = final.lstrip()
    if rendered[at : at + len(kept)] == kept:
        return rendered[: at + len(kept)]
    return rendered[: at + len(final.strip())]


def echoed_prefix(echo: bool, messages: list[ChatMessage]) -> str:
    """What an echoed answer starts with: the final message's text when the assistant wrote
    it (vLLM's echo on chat), else nothing. Text parts join with newlines, as in the prompt."""
    if not echo or not messages or messages[-1].role != "assistant":
        return ""
    content = messages[-1].content
    if isinstance(content, list):
        return "\n".join(part.text or "" for part in content)
    return content or ""


def truncate_prompt(
    token_ids: list[int], text: str | None, keep: int | None, max_model_len: int
) -> tuple[list[int], str | None]:
    """vLLM's truncate_prompt_tokens: the last `keep` tokens (-1: as many as the context
    holds, which leaves no room to generate: the request is then refused as too long); the
    text is dropped when tokens were cut (an echo decodes what is left)."""
    kept = truncated(token_ids, keep, max_model_len)
    return kept, text if len(kept) == len(token_ids) else None
