"""The tokenizer.json tokenizer read without transformers gives transformers' token ids,
text, special tokens and chat rendering (the embedded model's, a Llama-3-style BPE that
adds its BOS, a WordPiece whose decoding cleans up spaces), and is not used where
transformers' class could differ; the engine then loads transformers' class."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from headspace.model.tokenizer import (
    CHAT_ROLES,
    JsonTokenizer,
    chat_ids,
    empty_message_tokens,
    load_json_tokenizer,
    load_tokenizer,
    tokens_at_least,
)

TEXTS = ["", "Hello, world!", "  two  spaces\nand a line\t tab", "Ünïcode ✓ 数字 123 🙂",
         "<|im_start|>user\nhi<|im_end|>", "don't stop . , ? ! it 's", "a" * 300]  # fmt: skip
BPE_CLEAN_UP = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "One"}, {"role": "assistant", "content": "Two"},
     {"role": "user", "content": "Three ✓"}],
]  # fmt: skip


def _transformers(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _assert_alike(lite: JsonTokenizer, theirs, texts: list[str]) -> None:
    """Ids with and without special tokens, text back with and without them and with
    either clean-up, the named special tokens and their ids."""
    for text in texts:
        for special in (True, False):
            encoded = lite(text, add_special_tokens=special)
            assert dict(encoded) == dict(theirs(text, add_special_tokens=special)), (text, special)
            ids = encoded.input_ids
            for skip in (True, False):
                for clean in (None, False, True):
                    kwargs = {"skip_special_tokens": skip, "clean_up_tokenization_spaces": clean}
                    got = lite.decode(ids, **kwargs)
                    assert got == theirs.decode(ids, **kwargs), (text, kwargs)
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(lite, name) == getattr(theirs, name), name
        assert getattr(lite, f"{name}_id") == getattr(theirs, f"{name}_id"), name


def _assert_chats_alike(lite: JsonTokenizer, theirs) -> None:
    for conversation in CONVERSATIONS:
        for prompt in (True, False):
            encoded = lite.apply_chat_template(conversation, add_generation_prompt=prompt)
            expected = theirs.apply_chat_template(conversation, add_generation_prompt=prompt)
            assert dict(encoded) == dict(expected)
            assert lite.apply_chat_template(conversation, add_generation_prompt=prompt,
                                            return_dict=False) == expected["input_ids"]  # fmt: skip
            text = lite.apply_chat_template(conversation, add_generation_prompt=prompt,
                                            tokenize=False)  # fmt: skip
            assert text == theirs.apply_chat_template(conversation, add_generation_prompt=prompt,
                                                      tokenize=False)  # fmt: skip


@pytest.fixture(scope="module")
def embedded_pair(embedded_dir):
    lite = load_json_tokenizer(embedded_dir)
    assert isinstance(lite, JsonTokenizer)
    return lite, _transformers(embedded_dir)


def test_the_embedded_tokenizer_reads_as_transformers_reads_it(embedded_pair):
    lite, theirs = embedded_pair
    _assert_alike(lite, theirs, TEXTS)
    _assert_chats_alike(lite, theirs)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(text=st.text(max_size=120))
def test_any_text_encodes_and_decodes_as_transformers_does(embedded_pair, text):
    lite, theirs = embedded_pair
    ids = lite(text).input_ids
    assert ids == theirs(text)["input_ids"]
    text_back = lite.decode(ids, skip_special_tokens=True)
    assert text_back == theirs.decode(ids, skip_special_tokens=True)


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(words=st.lists(st.sampled_from(["sea", "  ", "light\n", "1234", "ü✓", "a" * 40, "."]),
                      min_size=1, max_size=60), piece=st.integers(8, 64))  # fmt: skip
def test_tokens_counted_in_pieces_never_exceed_the_whole_count(embedded_pair, words, piece):
    """The bound a server refuses huge prompts by, on any text and piece size, for both
    tokenizers; it stops once past ``past``, having tokenized about that much text."""
    text = " ".join(words)
    for tokenizer in embedded_pair:
        whole = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert tokens_at_least(tokenizer, text, 10**9, piece) <= whole
        assert tokens_at_least(tokenizer, text, 10**9, len(text)) == whole  # one piece
    long_text = "the harbour at dawn " * 5000
    assert tokens_at_least(embedded_pair[0], long_text, 100, 64) < 200


def test_text_with_no_space_to_cut_at_is_counted_in_pieces_too(embedded_pair):
    """A base64 blob or CJK text has no lone space to cut at: it is cut inside a word
    (its bound still at most the whole count), and text far past ``past`` is tokenized
    only about that far (one piece of 15 MB was tokenized whole, seconds of every other
    request's time)."""
    for tokenizer in embedded_pair:
        for text in ("QUJDRA" * 2000, "漢字かな" * 2000, "a" * 9000, "x=1;" * 3000):
            whole = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            assert tokens_at_least(tokenizer, text, 10**9, 1000) <= whole
    seen: list[int] = []

    def counting(piece: str, add_special_tokens: bool):
        seen.append(len(piece))
        return embedded_pair[0](piece, add_special_tokens=add_special_tokens)

    assert tokens_at_least(counting, "QUJDRA" * 400_000, 1000, 4096) > 1000
    assert max(seen) <= 4096 and sum(seen) <= 10 * 4096


def _save(tokenizer, folder: Path, **config) -> Path:
    """``tokenizer`` (a transformers fast tokenizer) saved beside a llama config.json."""
    tokenizer.save_pretrained(folder)
    config_json = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    (folder / "config.json").write_text(json.dumps(config_json))
    if config:
        path = folder / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder


def _bpe_with_bos(folder: Path) -> Path:
    """A byte-level BPE whose post-processor adds a BOS, with a Llama-3-style chat
    template, trained on a few sentences and saved as transformers saves it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    backend.train_from_iterator(TEXTS * 20 + ["the quick brown fox jumps over the lazy dog"] * 50,
                                trainer)  # fmt: skip
    bos = backend.token_to_id(special[0])
    backend.post_processor = processors.TemplateProcessing(
        single=f"{special[0]} $A", pair=f"{special[0]} $A {special[0]} $B",
        special_tokens=[(special[0], bos)])  # fmt: skip
    template = (
        "{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
    )
    wrapped = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=special[0],
                                      eos_token=special[1])  # fmt: skip
    wrapped.chat_template = template
    return _save(wrapped, folder)


def test_a_bpe_that_adds_its_bos_reads_as_transformers_reads_it(tmp_path):
    folder = _bpe_with_bos(tmp_path / "bpe")
    lite = load_json_tokenizer(folder)
    assert isinstance(lite, JsonTokenizer)
    theirs = _transformers(folder)
    assert lite("the fox").input_ids[0] == lite.bos_token_id  # its post-processor's BOS
    _assert_alike(lite, theirs, TEXTS + ["the quick brown fox"])
    _assert_chats_alike(lite, theirs)


def test_a_wordpiece_cleans_up_decoded_spaces_as_transformers_does(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[SEP]", "it", "'", "s", "don", "t", ".", ",", "?", "!", "a", "dog", "n"]
    backend = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]",
                                      eos_token="[SEP]")  # fmt: skip
    folder = _save(wrapped, tmp_path / "wordpiece", clean_up_tokenization_spaces=True)
    lite = load_json_tokenizer(folder)
    assert isinstance(lite, JsonTokenizer)
    theirs = _transformers(folder)
    ids = lite("it's a dog. don't?").input_ids
    cleaned = lite.decode(ids)
    assert cleaned == theirs.decode(ids) != lite.decode(ids, clean_up_tokenization_spaces=False)
    _assert_alike(lite, theirs, ["it's a dog. don't?", "a , dog !"])


def _changed(embedded_dir: Path, folder: Path, files: dict[str, dict | str]) -> Path:
    shutil.copytree(embedded_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    for name, change in files.items():
        path = folder / name
        if isinstance(change, str):
            path.write_text(change)
        else:
            path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    return folder


def test_what_transformers_class_could_change_goes_to_transformers(embedded_dir, tmp_path):
    """Each case that this reader does not mirror is left to transformers: another saved
    class or model type (AutoTokenizer reads the type, not the architecture), tokens or
    templates in files transformers reads beside the config, config keys it applies (more
    special tokens, input names, a forced clean-up), truncation saved in the backend, a
    named special token the backend does not hold as a special added token, an added token
    held otherwise, two chat templates, one with assistant masks or one jinja cannot read;
    the engine then loads transformers' tokenizer."""
    backend = json.loads((embedded_dir / "tokenizer.json").read_text())
    keys = ("content", "lstrip", "rstrip", "normalized", "single_word", "special")
    token = backend["added_tokens"][0]  # held otherwise: its lstrip flipped
    added = {str(token["id"]): {**{k: token[k] for k in keys}, "lstrip": not token["lstrip"]}}
    tokens = [{**t, "special": t["content"] != "<|im_start|>"} for t in backend["added_tokens"]]
    plain = {**backend, "added_tokens": tokens}  # its BOS and EOS held as plain added tokens
    truncation = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    config = "tokenizer_config.json"
    cases = {
        "class": {config: {"tokenizer_class": "GPT2Tokenizer"}},
        "type": {"config.json": {"model_type": "qwen2"}},
        "family": {"config.json": {"model_type": "mistral",
                                   "architectures": ["MistralForCausalLM"]}},
        "tokens map": {"special_tokens_map.json": json.dumps({"eos_token": "<|im_end|>"})},
        "added file": {"added_tokens.json": json.dumps({"<tool>": 49152})},
        "extra": {config: {"extra_special_tokens": ["<tool>"]}},
        "named": {config: {"image_token": "<image>"}},
        "inputs": {config: {"model_input_names": ["input_ids", "token_type_ids"]}},
        "clean": {config: {BPE_CLEAN_UP: True}},
        "files": {config: {"fast_tokenizer_files": ["tokenizer.4.0.json"]}},
        "truncation": {"tokenizer.json": json.dumps({**backend, "truncation": truncation})},
        "special": {config: {"pad_token": "hello"}},
        "not special": {"tokenizer.json": json.dumps(plain)},
        "added": {config: {"added_tokens_decoder": added}},
        "added, partly": {config: {"added_tokens_decoder": {
            str(token["id"]): {"content": token["content"], "special": token["special"]}}}},
        "model tokens": {config: {"model_specific_special_tokens": {"image_token": "<image>"}}},
        "empty": {config: {"pad_token": ""}},
        "padding": {config: {"tokenizer_padding": {"pad_token": "<|im_end|>", "pad_id": 2}}},
        "templates": {config: {"chat_template": "{{ messages }}"}},
        "masks": {"chat_template.jinja": "{% for m in messages %}{% generation %}{{ m.content }}"
                                         "{% endgeneration %}{% endfor %}"},
        "syntax": {"chat_template.jinja": "{% for m in messages %}{{ m.content }}"},
    }  # fmt: skip
    for name, files in cases.items():
        folder = _changed(embedded_dir, tmp_path / name, files)
        assert load_json_tokenizer(folder) is None, name
    for name in ("tokens map", "not special"):
        loaded = load_tokenizer(tmp_path / name)
        assert not isinstance(loaded, JsonTokenizer)
        theirs = _transformers(tmp_path / name)
        ids = theirs("<|im_start|>hi")["input_ids"]
        assert loaded("<|im_start|>hi")["input_ids"] == ids
        assert loaded.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids, skip_special_tokens=True)  # fmt: skip
        assert loaded.eos_token_id == theirs.eos_token_id


def test_what_it_does_not_take_is_refused_and_one_id_or_an_encoding_decodes(embedded_pair):
    """transformers' other chat arguments are refused (LLM.tokenizer, transformers' own,
    takes them) rather than rendered into the template; a batch too; ``decode`` takes one
    id or an encoding as transformers' does."""
    lite, theirs = embedded_pair
    chat = CONVERSATIONS[0]
    for extra in ({"tools": []}, {"continue_final_message": True}, {"return_tensors": "pt"},
                  {"chat_template": "{{ messages }}"}, {"max_length": 3}):  # fmt: skip
        with pytest.raises(TypeError, match=next(iter(extra))):
            lite.apply_chat_template(chat, **extra)
    with pytest.raises(TypeError):
        lite.apply_chat_template([chat, chat])
    with pytest.raises(TypeError):
        lite(["a", "b"])
    encoded = lite("hi there")
    assert lite.decode(encoded) == theirs.decode(theirs("hi there")) == "hi there"
    assert lite.decode(encoded.input_ids[0]) == theirs.decode(encoded.input_ids[0])


def test_the_engine_loads_the_embedded_tokenizer_without_importing_transformers(embedded_dir):
    code = ("import sys; from pathlib import Path; from headspace.model.tokenizer import "
            f"load_tokenizer; t = load_tokenizer(Path({str(embedded_dir)!r})); "
            "print(type(t).__name__, 'transformers' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ["JsonTokenizer", "False"], out.stderr


# a template that wraps a run of tool results in one user turn (as Qwen's and Hermes') and
# merges a first system message into the first user turn (as Gemma's)
GROUPING_TEMPLATE = """
{%- for m in messages -%}
{%- if m.role == 'system' and loop.first -%}{{ m.content }}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif -%}
<r>{{ m.content }}</r>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{% endif -%}
{%- else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}"""


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(roles=st.lists(st.sampled_from(CHAT_ROLES), min_size=1, max_size=12),
       grouping=st.booleans())  # fmt: skip
def test_empty_messages_count_at_least_their_roles_tokens(embedded_pair, roles, grouping):
    """What the engine counts ahead of the template for a conversation of empty messages
    (each role's tokens for one more, :func:`empty_message_tokens`, past the first message)
    never passes what the template renders, with the embedded model's template and with
    one that wraps runs of tool results once and merges a first system message; and with
    the embedded one every role counts (a conversation of empty messages of any role is
    refused by its count, not rendered whole)."""
    lite, _ = embedded_pair
    if grouping:
        lite = JsonTokenizer(lite.backend_tokenizer, lite.special, GROUPING_TEMPLATE)
    added = empty_message_tokens(lite)
    assert set(added) == set(CHAT_ROLES) and (grouping or min(added.values()) > 0)
    conversation = [{"role": role, "content": ""} for role in roles]
    rendered = len(chat_ids(lite, conversation, add_generation_prompt=True))
    assert sum(added[role] for role in roles[1:]) <= rendered
