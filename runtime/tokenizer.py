"""The tokenizer a server needs, from an engine's tokenizer files through the `tokenizers`
library directly: about 0.3 s of CPU to load, where transformers' AutoTokenizer costs
several seconds of imports first.

It offers the part of a Hugging Face fast tokenizer the server uses, with the same results
(tests/unit/test_tokenizer.py compares them): encoding with or without the special tokens
the post-processor adds, decoding with or without special tokens, the vocabulary size,
the special tokens of tokenizer_config.json, and the chat template rendered as transformers
renders it (a sandboxed jinja2 environment with trim_blocks and lstrip_blocks, loop
controls, its `tojson`, `raise_exception`, `strftime_now` and `{% generation %}`), then
encoded without special tokens.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


def _content(token: Any) -> str | None:
    """tokenizer_config.json spells a special token as a string or an AddedToken dict."""
    if isinstance(token, str):
        return token
    if isinstance(token, Mapping) and isinstance(token.get("content"), str):
        return token["content"]
    return None


def _read_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    jinja = directory / CHAT_TEMPLATE_FILES[0]
    if jinja.is_file():
        return jinja.read_text()
    legacy = directory / CHAT_TEMPLATE_FILES[1]
    if legacy.is_file():
        value = json.loads(legacy.read_text()).get("chat_template")
    else:
        value = config.get("chat_template")
    if isinstance(value, list):  # named templates: the default one
        value = next((t.get("template") for t in value if t.get("name") == "default"), None)
    return value if isinstance(value, str) else None


class FastTokenizer:
    def __init__(self, directory: Path) -> None:
        from tokenizers import AddedToken, Tokenizer

        directory = Path(directory)
        self._tok = Tokenizer.from_file(str(directory / TOKENIZER_JSON))
        cfg_path = directory / TOKENIZER_CONFIG
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.special: dict[str, str] = {}
        for name in _SPECIAL:
            text = _content(self.config.get(name))
            if text is None:
                continue
            if self._tok.token_to_id(text) is None:  # as transformers does: add it
                self._tok.add_special_tokens([AddedToken(text, special=True)])
            self.special[name] = text
        extra = self.config.get("additional_special_tokens") or self.config.get(
            "extra_special_tokens") or []
        missing = [t for t in (_content(x) for x in extra) if t and self._tok.token_to_id(t) is None]
        if missing:
            self._tok.add_special_tokens([AddedToken(t, special=True) for t in missing])
        self.chat_template = _read_template(directory, self.config)
        self.clean_up_tokenization_spaces = bool(self.config.get("clean_up_tokenization_spaces",
                                                                 False))

    # ---- special tokens ----------------------------------------------------------------

    def _id(self, name: str) -> int | None:
        text = self.special.get(name)
        return None if text is None else self._tok.token_to_id(text)

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._id("unk_token")

    @property
    def eos_token(self) -> str | None:
        return self.special.get("eos_token")

    # ---- encode / decode ---------------------------------------------------------------

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = self.encode(text, add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def decode(self, ids: Sequence[int] | int, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        if isinstance(ids, int):
            ids = [ids]
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None \
            else clean_up_tokenization_spaces
        return _clean_up(text) if clean else text

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self._tok.id_to_token(i) for i in ids]

    # ---- chat template -----------------------------------------------------------------

    @cached_property
    def _template(self) -> Any:
        assert self.chat_template is not None
        return _environment().from_string(self.chat_template)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False,
                    **kwargs: Any) -> str:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        return self._template.render(messages=[dict(m) for m in messages],
                                     add_generation_prompt=add_generation_prompt,
                                     **{"tools": None, "documents": None, **self.special,
                                        **kwargs})

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            return_dict: bool = False, **kwargs: Any) -> Any:
        text = self.render_chat(messages, add_generation_prompt, **kwargs)
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids

    # ---- structured output ---------------------------------------------------------------

    def xgrammar_info(self, vocab_size: int, stop_token_ids: Sequence[int] | None) -> Any:
        """xgrammar's TokenizerInfo, detected as its from_huggingface does for a fast
        tokenizer (the vocabulary, and the vocabulary type from the serialized backend)."""
        import xgrammar as xgr

        vocab = self.get_vocab()
        encoded = [""] * vocab_size
        for token, idx in vocab.items():
            if idx < vocab_size:
                encoded[idx] = token
        info = xgr.TokenizerInfo
        meta = info._detect_metadata_from_hf(self._tok.to_str())
        from_vocab = info._detect_vocab_type_from_vocab(vocab)
        if from_vocab is not None and from_vocab != meta["vocab_type"]:
            meta = {"vocab_type": from_vocab,
                    "add_prefix_space": info._detect_add_prefix_space_by_encoding(self, from_vocab)}
        stops = list(stop_token_ids) if stop_token_ids else (
            [self.eos_token_id] if self.eos_token_id is not None else None)
        return info(encoded, vocab_type=meta["vocab_type"], vocab_size=vocab_size,
                    stop_token_ids=stops, add_prefix_space=meta["add_prefix_space"])


def _clean_up(text: str) -> str:
    """transformers' clean_up_tokenization."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                 (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


def _environment() -> Any:
    """The jinja2 environment transformers renders chat templates in."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # `{% generation %}...{% endgeneration %}`: the body as is
        tags = {"generation"}  # noqa: RUF012 (jinja's own class attribute)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body) \
                .set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env
