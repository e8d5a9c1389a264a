"""What the model reads: a request's prompt as token ids.

A completion's prompt comes in four forms (a string, strings, token ids, lists of token
ids). Strings are encoded as vLLM does: with the tokenizer's special tokens (a Llama
tokenizer's BOS) unless ``add_special_tokens`` is false; token ids are taken as given.
Chat messages go through the tokenizer's chat template, which writes the special tokens
itself, so its text is encoded without them unless asked.

A chat template is code, so a client may only fill in its variables: ``chat_template_kwargs``
may name a variable the template reads and the server does not set (``check_template_kwargs``),
never a template of its own (vLLM refuses ``chat_template`` there too). A template that
cannot render the messages is the caller's input, so a 400 naming ``messages``; the
template's own refusal (``raise_exception``) is quoted, anything else goes to the log.

These functions block (a template renders in Python, a long prompt takes a while to
encode): the endpoints run them through ``offload.Offload``.
"""

from __future__ import annotations

import copy
import inspect
import logging
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.sandbox

from spyre_serve.server.launch.settings import chat_template_text
from spyre_serve.server.openai.errors import APIError
from spyre_serve.server.openai.generation.protocol import ChatMessage

log = logging.getLogger("spyre_serve.api")

# Template variables the server sets itself (transformers' apply_chat_template and its
# template globals), so never a client's: messages, the generation prompt, tools, and the
# functions a template may call. The tokenizer's special tokens join them (``server_variables``).
SERVER_VARIABLES = frozenset({"messages", "add_generation_prompt", "continue_final_message", "tools",
                              "documents", "chat_template", "tokenize", "raise_exception", "strftime_now"})


def with_chat_template(tokenizer, template: str | None):
    """``tokenizer``, or a copy of it rendering ``template`` (``--chat-template``: a file's
    path, or the template itself) instead of its own."""
    if template is None:
        return tokenizer
    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = chat_template_text(template)
    return tokenizer


def completion_prompts(tokenizer, prompt: str | list[str] | list[int] | list[list[int]],
                       add_special_tokens: bool = True) -> list[list[int]]:
    """One token-id list per prompt."""
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt, add_special_tokens=add_special_tokens)]
    if all(isinstance(x, str) for x in prompt):
        return [tokenizer.encode(x, add_special_tokens=add_special_tokens) for x in prompt]
    if all(isinstance(x, int) for x in prompt):
        return [list(prompt)]
    return [list(x) for x in prompt]


def truncated(prompts: list[list[int]], keep: int | None, max_model_len: int) -> list[list[int]]:
    """vLLM's ``truncate_prompt_tokens``: each prompt's last ``keep`` tokens (-1: the context
    length); None keeps them whole. More than the context holds is a 400."""
    if keep is None:
        return prompts
    if keep > max_model_len:
        raise APIError(400, f"truncate_prompt_tokens ({keep}) is over this model's context length "
                            f"({max_model_len})", "truncate_prompt_tokens")
    keep = max_model_len if keep == -1 else keep
    return [ids[-keep:] for ids in prompts]


class _GenerationTag(jinja2.ext.Extension):
    """Parses ``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask tag) so
    that templates using it can be read for their variables."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


@lru_cache(maxsize=8)
def template_variables(template: str) -> frozenset[str] | None:
    """The variables ``template`` reads without setting them; None if it does not parse."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateError:
        return None


def the_template(tokenizer) -> str | None:
    """The tokenizer's chat template (its default one when it has several)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) else None


def server_variables(tokenizer) -> frozenset[str]:
    """``SERVER_VARIABLES``, the tokenizer's special tokens (transformers hands them to the
    template) and the named parameters of its ``apply_chat_template`` (a kwarg of that name
    would change how it renders, not fill a variable)."""
    try:
        parameters = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    except (TypeError, ValueError, AttributeError):
        parameters = ()
    named = {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return SERVER_VARIABLES | frozenset(getattr(tokenizer, "special_tokens_map", None) or ()) | named


def free_variables(tokenizer) -> list[str]:
    """The variables of the tokenizer's chat template a request may set, sorted."""
    template = the_template(tokenizer)
    readable = (template_variables(template) or frozenset()) if template else frozenset()
    return sorted(readable - server_variables(tokenizer))


def check_template_kwargs(tokenizer, kwargs: dict | None) -> dict:
    """``kwargs`` when each names a variable the chat template reads and the server leaves to
    the client; a 400 naming ``chat_template_kwargs`` otherwise."""
    if not kwargs:
        return {}
    if "chat_template" in kwargs:
        raise APIError(400, "chat_template_kwargs may not carry a chat_template: the server renders its "
                            "own (the model's, or --chat-template)", "chat_template_kwargs")
    reserved = server_variables(tokenizer)
    free = free_variables(tokenizer)
    for key in kwargs:
        if key in reserved:
            raise APIError(400, f"chat_template_kwargs may not set `{key}`: the server sets it", "chat_template_kwargs")
        if key not in free:
            offer = f"its variables are {', '.join(free[:20])}" if free else "it reads no variables a request may set"
            raise APIError(400, f"chat_template_kwargs: `{key[:100]}` is not a variable of this model's chat "
                                f"template ({offer})", "chat_template_kwargs")
    return kwargs


def chat_prompt(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool,
                template_kwargs: dict | None, add_special_tokens: bool = False,
                tools: list[dict] | None = None) -> list[int]:
    """The conversation rendered by the chat template, then encoded (without special tokens
    unless ``add_special_tokens``: the template writes them). ``tools`` (a chat request's, OpenAI's
    shape) is the template's ``tools`` variable, as transformers and vLLM hand it."""
    kwargs = check_template_kwargs(tokenizer, template_kwargs)
    convo = [m.for_template() for m in messages]
    try:
        if tools:
            kwargs = {**kwargs, "tools": tools}
        text = tokenizer.apply_chat_template(convo, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **kwargs)
    except jinja2.TemplateError as exc:
        raise APIError(400, f"the chat template could not render these messages: {_template_words(exc)}",
                       "messages") from None
    except Exception as exc:  # a failed render is the caller's input; what failed goes to the log
        log.info("the chat template failed on a request's messages", exc_info=exc)
        raise APIError(400, "the chat template could not render these messages", "messages") from None
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _template_words(exc: jinja2.TemplateError) -> str:
    """What the template said: the text of its ``raise_exception`` (a plain TemplateError),
    cut to 300 characters; a generic phrase for Jinja's own errors (an undefined name...)."""
    if type(exc) is jinja2.TemplateError and exc.message:
        return exc.message[:300]
    log.info("the chat template failed on a request's messages", exc_info=exc)
    return "the template failed on them"
