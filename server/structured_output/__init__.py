"""Structured output: JSON schemas, regexes, grammars and choices as a token mask per step.

    grammars.py  grammars compiled with llguidance, one matcher per sequence, its token mask
                 (the card applies it in the step's sampler)
    request.py   a request's structured-output fields (response_format, guided_*, tools'
                 forced calls) as one grammar, and its logit_bias as the card takes it

Imports ``llguidance``, ``jsonschema`` and ``server.openai``'s errors and fields. Imported by
``server.engine`` (masks each step), ``server.openai.generation`` and ``server.openai.responses``.
"""
