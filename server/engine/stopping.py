"""When a sequence stops: its end-of-sequence ids, the tokens ``min_tokens`` bans, and the
stop checks on each new token (in vLLM's order: EOS, stop token ids, stop strings, length)."""

from __future__ import annotations

from spyre_serve.server.sched.sequence import GenerationParams, Sequence


def eos_token_ids(config, tokenizer) -> frozenset[int]:
    """Every id that ends a sequence: the model config's ``eos_token_id`` (a list in
    ``models.config``; an int or None from other runners) plus the tokenizer's."""
    ids = getattr(config, "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    return frozenset(int(t) for t in ids)


def banned_tokens(p: GenerationParams, eos_ids: frozenset[int], vocab_size: int) -> list[int]:
    """Tokens that would stop the sequence (every EOS id unless ignore_eos, and
    stop_token_ids): vLLM's min_tokens keeps them from being sampled, not just from
    stopping. Ids outside the vocabulary are never sampled anyway and are left out."""
    ids = list(p.stop_token_ids)
    if not p.ignore_eos:
        ids.extend(eos_ids)
    return sorted({t for t in ids if 0 <= t < vocab_size})


def keep_stop_text(seq: Sequence, token: int) -> None:
    """A token that stops ``seq`` (an EOS or stop token id) is left out of its text unless
    ``include_stop_str_in_output`` (vLLM); a special one decodes to nothing unless
    ``skip_special_tokens`` is false."""
    if seq.params.include_stop_str_in_output:
        seq.text += seq.detok.add(token) + seq.detok.flush()


def check_stop(seq: Sequence, token: int, eos_ids: frozenset[int],
               max_model_len: int) -> tuple[str, int | str | None] | None:
    """``token`` has just joined ``seq``: detokenize it into the sequence's text and say
    whether the sequence stops, as (finish_reason, stop_reason), or None."""
    p = seq.params
    allow_stop = seq.num_generated >= p.min_tokens
    if allow_stop and not p.ignore_eos and token in eos_ids:
        keep_stop_text(seq, token)
        return "stop", None
    if allow_stop and token in p.stop_token_ids:
        keep_stop_text(seq, token)
        return "stop", token
    stop = seq.append_text(seq.detok.add(token))
    if stop is not None:
        return "stop", stop
    if seq.num_generated >= p.max_tokens or len(seq.token_ids) >= max_model_len:
        seq.append_text(seq.detok.flush())  # an incomplete last character, as decode() shows it
        return "length", None
    return None
