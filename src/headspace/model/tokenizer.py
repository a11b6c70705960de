"""A checkpoint's tokenizer, read by the ``tokenizers`` library alone where that is exact.

transformers' import takes seconds of a fresh process (its dependency checks and module
tables: 1.2 s of ``headspace generate``'s 3.6-4.6 on a 2-core CPU, 1.7 s on a GPU host),
and the engine needs only what ``tokenizers`` and ``jinja2`` do: text to ids, ids to text,
the special tokens and the chat template. :func:`load_tokenizer` gives the engine a
:class:`JsonTokenizer` where it gives the same ids and text as the class transformers would
build (a llama checkpoint's ``tokenizer.json`` saved under the fast class, nothing in its
files that the class would apply beyond the backend: tests/test_tokenizer.py holds them
equal), and transformers' tokenizer everywhere else. :func:`transformers_tokenizer` is
transformers' own, for callers that want its whole interface (``LLM.tokenizer``).
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import cache, lru_cache
from pathlib import Path

from headspace.errors import UserError

# the class names a tokenizer.json-backed tokenizer is saved under (transformers 4 and 5), and
# the model types for which AutoTokenizer then builds that class itself (for others, such as
# qwen2, it builds the model's own tokenizer class)
FAST_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
FAST_TOKENIZER_TYPES = ("llama", "mistral")
# ... of which JsonTokenizer reads these (mistral's regex may be patched by transformers)
JSON_TOKENIZER_TYPES = ("llama",)
# the named special tokens, as transformers passes them to a chat template
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")  # fmt: skip
# tokenizer config keys that transformers' class applies beyond the backend
NOT_MIRRORED_KEYS = (
    "additional_special_tokens", "extra_special_tokens", "split_special_tokens",
    "model_specific_special_tokens", "fix_mistral_regex", "fast_tokenizer_files", "auto_map",
    "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
    "tokenizer_padding", "tokenizer_truncation", "_json_padding", "_json_truncation",
    "post_processor",
)  # fmt: skip
# files beside it that transformers reads for tokens or templates
NOT_MIRRORED_FILES = ("special_tokens_map.json", "added_tokens.json", "chat_template.json",
                      "additional_chat_templates")  # fmt: skip
# what transformers' clean-up of decoded text replaces (WordPiece-era spacing)
CLEAN_UP = (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), \
    (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")  # fmt: skip
# apply_chat_template's arguments in transformers that this reader does not take
TRANSFORMERS_ONLY = ("tools", "documents", "chat_template", "continue_final_message",
                     "return_assistant_tokens_mask", "padding", "truncation", "max_length",
                     "return_tensors", "tokenizer_kwargs")  # fmt: skip
INPUT_NAMES = ("input_ids", "attention_mask")  # what calling the tokenizer returns


class NotMirrored(Exception):
    """The checkpoint has something transformers' class applies that this reader does not."""


class Encoded(dict):
    """What calling a tokenizer returns: ``{"input_ids": [...], "attention_mask": [...]}``,
    its keys also read as attributes (``.input_ids``), as transformers' encodings are."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class JsonTokenizer:
    """Text to token ids and back through ``backend_tokenizer`` (a ``tokenizers.Tokenizer``),
    with the special tokens and chat template of the checkpoint's tokenizer config; called as
    transformers' tokenizers are (``tokenizer(text)["input_ids"]``, ``decode``,
    ``apply_chat_template``), one text at a time."""

    def __init__(self, backend_tokenizer, special: dict[str, str], chat_template: str | None,
                 clean_up: bool = False) -> None:  # fmt: skip
        self.backend_tokenizer = backend_tokenizer
        self.special = special  # named special token -> its text
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = clean_up

    def __call__(self, text: str, *, add_special_tokens: bool = True) -> Encoded:
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return Encoded(input_ids=ids, attention_mask=[1] * len(ids))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"this tokenizer encodes one text at a time, got {type(text)}")
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:  # fmt: skip
        """Text of ``token_ids`` (ids, one id, or an encoding); the clean-up (the config's
        by default) is skipped for BPE models, as transformers skips it."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        elif isinstance(token_ids, dict):
            token_ids = token_ids["input_ids"]
        text = self.backend_tokenizer.decode(list(token_ids),
                                             skip_special_tokens=skip_special_tokens)  # fmt: skip
        clean_up = clean_up_tokenization_spaces
        if clean_up is None:
            clean_up = self.clean_up_tokenization_spaces
        if clean_up and type(self.backend_tokenizer.model).__name__ != "BPE":
            for before, after in CLEAN_UP:
                text = text.replace(before, after)
        return text

    def __getattr__(self, name: str):
        """``bos_token`` .. ``mask_token`` (None where the config names none) and their
        ``..._id``s."""
        base = name.removesuffix("_id")
        if base not in SPECIAL_TOKEN_NAMES:
            raise AttributeError(name)
        token = self.special.get(base)
        if name == base or token is None:
            return token
        return self.backend_tokenizer.token_to_id(token)

    def apply_chat_template(self, conversation: list[dict], *, add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = True,
                            **kwargs) -> Encoded | list[int] | str:  # fmt: skip
        """One conversation (``{"role", "content"}`` dicts) rendered by the chat template as
        transformers renders it (the named special tokens and ``kwargs`` in its variables),
        tokenized (no special tokens added: the template writes them) into an encoding as
        calling the tokenizer gives, or ids alone without ``return_dict``; or the text.
        transformers' other arguments (tools, documents, ...) need ``LLM.tokenizer``."""
        taken = [name for name in TRANSFORMERS_ONLY if name in kwargs]
        if taken:
            raise TypeError(f"{', '.join(taken)}: not taken by this tokenizer; transformers' "
                            "tokenizer (LLM.tokenizer) takes them")  # fmt: skip
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if not conversation or not all(isinstance(m, dict) for m in conversation):
            raise TypeError("apply_chat_template takes one conversation: a list of messages")
        text = compile_chat_template(self.chat_template).render(
            messages=conversation, tools=None, documents=None,
            add_generation_prompt=add_generation_prompt, **{**self.special, **kwargs})  # fmt: skip
        if not tokenize:
            return text
        if return_dict:
            return self(text, add_special_tokens=False)
        return self.encode(text, add_special_tokens=False)


def _raise_exception(message: str):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """JSON that leaves HTML characters alone (jinja's own filter escapes them)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)  # fmt: skip


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_chat_template(template: str):
    """A jinja template in the environment transformers renders chat templates in: a
    sandbox, blocks trimmed, loop controls, ``raise_exception``, ``strftime_now`` and its
    ``tojson`` (its assistant-mask tag is not taken: such templates go to transformers)."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])  # fmt: skip
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise NotMirrored(f"{path.name} unreadable") from None


def _model_type(model_dir: Path) -> str | None:
    try:
        return _read_json(model_dir / "config.json").get("model_type")
    except NotMirrored:
        return None


def _check_config(model_dir: Path, config: dict) -> None:
    """Raise NotMirrored where transformers' class would apply more than the backend."""
    if _model_type(model_dir) not in JSON_TOKENIZER_TYPES:
        raise NotMirrored("model type")
    if config.get("tokenizer_class") not in FAST_TOKENIZER_CLASSES:
        raise NotMirrored("tokenizer class")
    if any((model_dir / name).exists() for name in NOT_MIRRORED_FILES):
        raise NotMirrored("tokens or templates in other files")
    if any(config.get(key) for key in NOT_MIRRORED_KEYS):
        raise NotMirrored("config keys")
    if config.get("model_input_names", list(INPUT_NAMES)) != list(INPUT_NAMES):
        raise NotMirrored("model input names")
    others = [key for key, value in config.items() if key.endswith("_token")
              and key not in SPECIAL_TOKEN_NAMES and isinstance(value, str | dict)]  # fmt: skip
    if others:  # transformers 5 makes each a named special token
        raise NotMirrored(f"special tokens {others}")


def _chat_template(model_dir: Path, config: dict) -> str | None:
    """The one chat template (None: none), compiled once to check that it is read here."""
    saved, path = config.get("chat_template"), model_dir / "chat_template.jinja"
    if saved is not None and (not isinstance(saved, str) or path.is_file()):
        raise NotMirrored("several chat templates")
    template = path.read_text(encoding="utf-8") if path.is_file() else saved
    if template is not None:
        try:  # (transformers' assistant-mask tag is not taken here: such templates fail)
            compile_chat_template(template)
        except Exception:  # jinja's own kinds: transformers' class has its own say
            raise NotMirrored("chat template not compiled here") from None
    return template


def _check_tokens(backend, special: dict[str, str], added: dict) -> None:
    """Each named special token must be an added special token of the backend, and each
    added token the config lists the backend's own at that id with the same properties:
    transformers' class would otherwise add or change tokens."""
    held = backend.get_added_tokens_decoder()  # id -> AddedToken
    by_text = {token.content: token for token in held.values()}
    if any(text not in by_text or not by_text[text].special for text in special.values()):
        raise NotMirrored("named special tokens")
    keys = ("content", "special", "lstrip", "rstrip", "normalized", "single_word")
    for index, saved in added.items():  # transformers adds each again, defaults where unsaid
        token = held.get(int(index))
        if token is None or not isinstance(saved, dict):
            raise NotMirrored("added tokens")
        if any(key not in saved or saved[key] != getattr(token, key) for key in keys):
            raise NotMirrored("added tokens")


def load_json_tokenizer(model_dir: Path) -> JsonTokenizer | None:
    """The checkpoint's tokenizer without transformers, or None where transformers' class
    could differ (:class:`NotMirrored`'s cases: another model type or saved class, config
    keys or files it applies, a named special token the backend does not hold as one, an
    added token held otherwise, truncation or padding saved in the backend, several chat
    templates or one not read here)."""
    files = {name: model_dir / name for name in ("tokenizer.json", "tokenizer_config.json")}
    if not all(path.is_file() for path in files.values()):
        return None
    from tokenizers import Tokenizer

    try:
        config = _read_json(files["tokenizer_config.json"])
        _check_config(model_dir, config)
        template = _chat_template(model_dir, config)
        backend = Tokenizer.from_file(str(files["tokenizer.json"]))
        if backend.truncation is not None or backend.padding is not None:
            raise NotMirrored("truncation or padding")
        special = {name: _content(config[name]) for name in SPECIAL_TOKEN_NAMES
                   if config.get(name) is not None}  # fmt: skip
        _check_tokens(backend, special, config.get("added_tokens_decoder") or {})
    except NotMirrored:
        return None
    clean_up = bool(config.get("clean_up_tokenization_spaces", False))
    return JsonTokenizer(backend, special, template, clean_up)


def _content(token) -> str:
    """A token as the config saves it: its text, or a dict holding it."""
    return token["content"] if isinstance(token, dict) else str(token)


def transformers_tokenizer_class(model_dir: Path):
    """The class transformers' tokenizer of ``model_dir`` is built from: the fast class itself
    where ``AutoTokenizer`` would build it too (a ``tokenizer.json`` saved under that class,
    for a model type in FAST_TOKENIZER_TYPES), without importing the model and generation
    modules ``AutoTokenizer`` imports (seconds at start-up); else ``AutoTokenizer``."""
    try:
        saved = _read_json(model_dir / "tokenizer_config.json")
    except NotMirrored:
        saved = {}
    if (model_dir / "tokenizer.json").is_file() and _model_type(model_dir) in FAST_TOKENIZER_TYPES \
            and saved.get("tokenizer_class") in FAST_TOKENIZER_CLASSES:  # fmt: skip
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast
    from transformers import AutoTokenizer

    return AutoTokenizer


def transformers_tokenizer(model_dir: Path):
    """transformers' tokenizer of ``model_dir`` (UserError, one line, where it fails)."""
    try:
        return transformers_tokenizer_class(model_dir).from_pretrained(str(model_dir))
    except Exception as exc:  # transformers raises several kinds for a bad tokenizer
        raise UserError(f"cannot load the tokenizer from {model_dir}: {exc}") from None


def load_tokenizer(model_dir: Path):
    """The engine's tokenizer of ``model_dir``: :func:`load_json_tokenizer`'s where it reads
    it, else transformers'. UserError where the directory has no tokenizer files or they
    cannot be read."""
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    if not any((model_dir / name).is_file() for name in names):
        raise UserError(f"model directory {model_dir} has no tokenizer files")
    try:
        tokenizer = load_json_tokenizer(model_dir)
    except Exception as exc:  # the backend's own errors for a bad tokenizer.json
        raise UserError(f"cannot load the tokenizer from {model_dir}: {exc}") from None
    return tokenizer if tokenizer is not None else transformers_tokenizer(model_dir)


PIECE_CHARS = 1 << 16  # characters of text tokenized at a time by ``tokens_at_least``
PIECE_MARGIN = 4  # tokens a cut between two pieces may add, at most, on any tokenizer here
HARD_CUT_MARGIN = 64  # the same for a cut inside a word (text with no lone space to cut at)
_CUT = re.compile(r"(?<=\S) (?=\S)")  # a lone space between words: BPE's pre-tokens keep


def tokens_at_least(tokenizer, text: str, past: int, piece_chars: int = PIECE_CHARS) -> int:
    """A lower bound on the tokens of ``text`` (special tokens aside), found by tokenizing
    it in pieces of about ``piece_chars`` characters cut before a lone space (less
    ``PIECE_MARGIN`` a cut), or, where the next ``piece_chars`` characters hold none (a
    base64 blob, CJK text), cut inside a word (less ``HARD_CUT_MARGIN``); stops once the
    bound passes ``past``, so that text far past a context costs about ``past`` tokens'
    work, not its whole length (one piece of it was tokenized whole, holding the
    interpreter for seconds)."""
    count, start = 0, 0
    while start < len(text) and count <= past:
        end, margin = len(text), 0
        if len(text) - start > piece_chars:
            found = _CUT.search(text, start + piece_chars, start + 2 * piece_chars)
            end, margin = ((found.start(), PIECE_MARGIN) if found
                           else (start + piece_chars, HARD_CUT_MARGIN))  # fmt: skip
        count += len(tokenizer(text[start:end], add_special_tokens=False)["input_ids"]) - margin
        start = end
    return count


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """Token ids of a conversation through ``tokenizer``'s chat template (a list of ids
    whether the tokenizer returns a list or an encoding)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


CHAT_ROLES = ("user", "assistant", "system", "tool")


def empty_message_tokens(tokenizer) -> dict[str, int]:
    """Tokens the chat template gives one more empty message of each role of
    :data:`CHAT_ROLES` past a conversation's first: the fewest it adds after a user turn,
    after a user and an assistant turn, and after another of its role (templates that wrap
    a run of tool results once); 0 for a role it renders as nothing, or cannot render there
    (a template that refuses the role, or has none). A first message may add less (a
    system message merged into the first user turn, or in place of a default one)."""

    @cache  # (the conversations before each role are the same for every role)
    def count(*roles: str) -> int:
        return len(chat_ids(tokenizer, [{"role": r, "content": ""} for r in roles], False))

    added = {}
    for role in CHAT_ROLES:
        found = []
        for before in (("user",), ("user", "assistant"), ("user", role)):
            try:
                found.append(count(*before, role) - count(*before))
            except Exception:  # noqa: BLE001 (no template, or one that refuses this order)
                continue
        added[role] = max(0, min(found)) if found else 0
    return added
