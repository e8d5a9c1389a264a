"""PEFT's ``target_modules`` given as a regular expression, matched in linear time.

    TargetPattern(text).fullmatch("model.layers.0.self_attn.q_proj")   # PatternError: why refused

PEFT matches a string ``target_modules`` with ``re.fullmatch`` against each module's path. The
pattern comes from a file a client may name (``/v1/load_lora_adapter``), and ``re`` backtracks:
``.{7}(.|.)*Z`` took 14 s against one module path, in the engine process (issue 38). Here the
pattern is parsed into a Thompson automaton and run on the path as a set of states, so a match
costs (path length) x (states), whatever the pattern, and the states are capped.

What is read is what PEFT configs write (its own tied-embedding form ``(?:...|^name$)`` among
them): literals, ``.``, escaped punctuation, ``\\d \\w \\s`` and their negations, classes
``[...]`` (ranges, negation), groups ``(...)``, ``(?:...)``, ``(?P<name>...)``, ``|``, the
quantifiers ``* + ? {m} {m,} {m,n}`` (lazy ones too: for a yes/no match they are the same) and
the anchors ``^ $``. Lookarounds, backreferences, flags, possessive and atomic forms are refused,
as is a pattern over ``MAX_CHARS`` characters or one that unrolls to over ``MAX_STATES`` states.
"""

from __future__ import annotations

MAX_CHARS = 512      # the longest PEFT configs write are a few alternatives of module names
MAX_STATES = 1024    # a match costs (path length, ~35) x states
MAX_COUNT = 100      # the largest m or n of a {m,n}
MAX_GROUPS = 32      # groups in groups: the parser and compiler recurse once a level

PATTERN_FEATURES = (f"literals, '.', \\d \\w \\s, [classes], groups (...) (?:...) (?P<name>...), '|', "
                    f"* + ? {{m,n}} (counts up to {MAX_COUNT}), ^ $; at most {MAX_CHARS} characters")
_ESCAPES = {"d": str.isdecimal, "w": (lambda c: c.isalnum() or c == "_"), "s": str.isspace}   # as re's, Unicode


class PatternError(ValueError):
    """A pattern refused; the message says why, in a few words."""


class _Parser:
    """Recursive descent over the pattern into a tree: ("char", test), ("cat", [..]),
    ("alt", [..]), ("rep", node, min, max or None), ("bol",), ("eol",)."""

    def __init__(self, text: str) -> None:
        self.text, self.i, self.depth = text, 0, 0

    def peek(self) -> str | None:
        return self.text[self.i] if self.i < len(self.text) else None

    def take(self) -> str:
        if self.i >= len(self.text):
            raise PatternError("it ends early")
        self.i += 1
        return self.text[self.i - 1]

    def parse(self):
        node = self.alt()
        if self.i < len(self.text):
            raise PatternError(f"unbalanced ) at position {self.i}")
        return node

    def alt(self):
        branches = [self.cat()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.cat())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def cat(self):
        items = []
        while self.peek() not in (None, "|", ")"):
            items.append(self.repeat())
        return ("cat", items)

    def repeat(self):
        if self.peek() in ("*", "+", "?") or self._count() is not None:
            raise PatternError(f"nothing to repeat at position {self.i}")
        node = self.atom()
        c, count = self.peek(), self._count()
        if c in ("*", "+", "?"):
            self.i += 1
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        elif count is not None:
            low, high, self.i = count
        else:
            return node
        if node[0] in ("bol", "eol"):
            raise PatternError(f"nothing to repeat at position {self.i - 1}")
        if self.peek() == "+":
            raise PatternError("possessive quantifiers are not supported")
        self.i += self.peek() == "?"          # lazy: the same yes or no
        if self.peek() in ("*", "+", "?") or self._count() is not None:
            raise PatternError(f"multiple repeat at position {self.i}")
        return ("rep", node, low, high)

    def _count(self):
        """(min, max or None, the index after it) of a ``{m}``, ``{m,}``, ``{m,n}`` here."""
        if self.peek() != "{":
            return None
        end = self.text.find("}", self.i)
        low, comma, high = self.text[self.i + 1:end].partition(",") if end > 0 else ("", "", "")
        if not (low.isdigit() and (high.isdigit() or not high)) or not low.isascii() or not high.isascii():
            raise PatternError(f"a '{{' that is not a count {{m}}, {{m,}} or {{m,n}} at position {self.i}")
        low_n, high_n = int(low), (int(high) if high else None if comma else int(low))
        if high_n is not None and high_n < low_n:
            raise PatternError(f"a count {{{low},{high}}} with its maximum under its minimum")
        if max(low_n, high_n or 0) > MAX_COUNT:
            raise PatternError(f"a count over {MAX_COUNT} at position {self.i}")
        return low_n, high_n, end + 1

    def atom(self):
        c = self.take()
        if c == "(":
            self.depth += 1
            if self.depth > MAX_GROUPS:
                raise PatternError(f"groups nested over {MAX_GROUPS} deep")
            if self.peek() == "?":
                self.i += 1
                kind = self.take()
                if kind == "P" and self.peek() == "<":
                    end = self.text.find(">", self.i)
                    if end < 0 or not self.text[self.i + 1:end].isidentifier():
                        raise PatternError(f"a bad group name at position {self.i}")
                    self.i = end + 1
                elif kind in ("=", "!") or (kind == "<" and self.peek() in ("=", "!")):
                    raise PatternError("lookarounds are not supported")
                elif (kind == "P" and self.peek() == "=") or kind == "(":
                    raise PatternError("backreferences and conditionals are not supported")
                elif kind == ">":
                    raise PatternError("atomic groups are not supported")
                elif kind != ":":
                    raise PatternError("inline flags and other (?...) forms are not supported")
            node = self.alt()
            if self.peek() != ")":
                raise PatternError(f"missing ), unterminated group at position {self.i}")
            self.i, self.depth = self.i + 1, self.depth - 1
            return node
        if c == "[":
            return ("char", self._class())
        if c == ".":
            return ("char", lambda ch: ch != "\n")
        if c == "^":
            return ("bol",)
        if c == "$":
            return ("eol",)
        if c == "\\":
            c = self._escape()
        return ("char", c.__eq__ if isinstance(c, str) else c)

    def _escape(self):
        """The character escaped (a str), or the test of ``\\d \\w \\s \\D \\W \\S``."""
        c = self.take()
        if c.lower() in _ESCAPES:
            test = _ESCAPES[c.lower()]
            return test if c.islower() else (lambda ch: not test(ch))
        if c.isdigit():
            raise PatternError("backreferences are not supported")
        if c.isalnum() or not c.isascii():
            raise PatternError(f"the escape \\{c} is not supported")
        return c

    def _class(self):
        """The test of a ``[...]``: its characters, ranges and escapes, each character's answer
        kept (the states a count unrolls share one test)."""
        negate = self.peek() == "^"
        self.i += negate
        chars, tests, first = set(), [], True
        while first or self.peek() != "]":
            if self.peek() is None:
                raise PatternError("unterminated [ of a character class")
            first = False
            c = self.take()
            c = self._escape() if c == "\\" else c
            if isinstance(c, str) and self.peek() == "-" and self.text[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                high = self.take()
                high = self._escape() if high == "\\" else high
                if not isinstance(high, str) or high < c:
                    raise PatternError(f"a bad range at position {self.i} of a character class")
                tests.append(lambda ch, lo=c, hi=high: lo <= ch <= hi)
            elif isinstance(c, str):
                chars.add(c)
            else:
                tests.append(c)
        self.i += 1
        known: dict[str, bool] = {}

        def test(ch: str) -> bool:
            if ch not in known:
                known[ch] = (ch in chars or any(t(ch) for t in tests)) != negate
            return known[ch]
        return test


class TargetPattern:
    """A pattern compiled into states: ("char", test, next), ("split", [next, ..]), ("bol",
    next), ("eol", next), ("match",)."""

    def __init__(self, text: str) -> None:
        if not text:
            raise PatternError("it is empty")
        if len(text) > MAX_CHARS:
            raise PatternError(f"it is {len(text)} characters long, over {MAX_CHARS} characters")
        self.states: list = [("match",)]
        self.work = 0
        self.start = self._compile(_Parser(text).parse(), 0)

    def _add(self, state) -> int:
        if len(self.states) >= MAX_STATES:
            raise PatternError(f"its repetitions unroll to more than {MAX_STATES} states: too large")
        self.states.append(state)
        return len(self.states) - 1

    def _compile(self, node, nxt: int) -> int:
        """The state that matches ``node`` and then goes on to ``nxt``."""
        self.work += 1              # an empty group repeated adds no state, but costs its calls
        if self.work > 4 * MAX_STATES:
            raise PatternError(f"its repetitions unroll to more than {MAX_STATES} states: too large")
        kind = node[0]
        if kind == "char":
            return self._add(("char", node[1], nxt))
        if kind in ("bol", "eol"):
            return self._add((kind, nxt))
        if kind == "cat":
            for item in reversed(node[1]):
                nxt = self._compile(item, nxt)
            return nxt
        if kind == "alt":
            return self._add(("split", [self._compile(b, nxt) for b in node[1]]))
        _, body, low, high = node
        if high is None:                     # body*, its loop: split -> body -> split | nxt
            loop = self._add(None)
            self.states[loop] = ("split", [self._compile(body, loop), nxt])
            nxt = loop
        else:
            for _ in range(high - low):      # nested optionals: (body(body)?)?
                nxt = self._add(("split", [self._compile(body, nxt), nxt]))
        for _ in range(low):
            nxt = self._compile(body, nxt)
        return nxt

    def _closure(self, starts, pos: int, end: int) -> set[int]:
        """Every state reached from ``starts`` at ``pos`` without reading a character."""
        seen, stack = set(), list(starts)
        while stack:
            s = stack.pop()
            if s in seen:
                continue
            seen.add(s)
            state = self.states[s]
            if state[0] == "split":
                stack.extend(state[1])
            elif (state[0] == "bol" and pos == 0) or (state[0] == "eol" and pos == end):
                stack.append(state[1])
        return seen

    def fullmatch(self, text: str) -> bool:
        """Whether the pattern matches the whole of ``text`` (as ``re.fullmatch``)."""
        current = self._closure([self.start], 0, len(text))
        for pos, ch in enumerate(text):
            moved = [st[2] for s in current if (st := self.states[s])[0] == "char" and st[1](ch)]
            if not moved:
                return False
            current = self._closure(moved, pos + 1, len(text))
        return 0 in current
