"""The data section of the run config: where documents come from (`data.sources`, each a `SourceConfig`), how
they become training sequences, and what is held out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, model_validator

from clustertrain.config.section import ConfigPath, Section

SOURCE_FORMATS = ("auto", "text", "jsonl", "json", "csv", "parquet", "arrow", "hf_disk", "hf", "tokens", "stdlib")
# Formats of files, told by their extensions (clustertrain.data.sources.FILE_READERS); the others are a choice,
# a save_to_disk directory, a dataset name and the standard library.
FILE_FORMATS = tuple(fmt for fmt in SOURCE_FORMATS if fmt not in ("auto", "hf_disk", "hf", "stdlib"))


# "block" is the older name of "paragraph"
TextUnit = Annotated[Literal["file", "paragraph", "line"],
                     BeforeValidator(lambda v: "paragraph" if v == "block" else v)]


class SourceConfig(Section):
    path: ConfigPath | None = Field(None, description="A file, a directory of shards, a glob, or a folder `clustertrain stage "
                             "dataset` wrote (its complete manifest lists the shards).")
    hf_name: str | None = Field(None, description="A Hugging Face dataset name, read from the local HF cache "
                                "(offline).")
    hf_config: str | None = Field(None, description="The dataset's config (subset) name, for hf_name.")
    split: str = Field("train", description="The dataset split, for hf_name and hf_disk.")
    format: Literal[SOURCE_FORMATS] = Field(  # type: ignore[valid-type]
        "auto",
        description="auto (from the extension), text, jsonl, json, csv (with a header row), parquet, arrow, hf_disk "
        "(save_to_disk), hf, "
        "tokens (.npy/.bin token ids), stdlib (the running Python's standard library).",
    )
    field: str = Field("text", description="The record field that holds the text (jsonl, json, csv, parquet, arrow, "
                       "hf).")
    text_unit: TextUnit = Field(
        "file", description="For .txt: one document per file, per blank-line-separated paragraph (also spelled "
        "block), or per non-blank line (a corpus of one example per line)."
    )
    token_dtype: Literal["uint16", "uint32"] = Field("uint16", description="Element type of .bin token files.")
    weight: float = Field(1.0, gt=0, allow_inf_nan=False, description="Mixture weight (normalized over the sources).")
    name: str | None = Field(None, description="Label in logs and audits; default: the file stem or dataset name.")
    max_bytes: int | None = Field(None, gt=0, description="stdlib only: read at most this many bytes.")

    @model_validator(mode="after")
    def _one_origin(self) -> SourceConfig:
        if self.format == "stdlib":
            return self
        if (self.path is None) == (self.hf_name is None):
            raise ValueError("give exactly one of path or hf_name")
        if self.hf_name is not None and self.format not in ("auto", "hf"):
            raise ValueError(f"hf_name sources are read with format 'hf', not {self.format!r}")
        return self

    @property
    def label(self) -> str:
        """The source's name in logs, audits and sample fingerprints."""
        if self.name:
            return self.name
        if self.format == "stdlib":
            return "stdlib"
        return self.hf_name or Path(self.path or "").stem or str(self.path)


class DataConfig(Section):
    mode: Literal["pretrain", "sft", "random"] = Field(
        "pretrain",
        description="pretrain: documents joined with EOS and packed; sft: prompt/response records, loss on "
        "responses only (see loss_on); random: random token ids, no sources (pipeline checks).",
    )
    loss_on: Literal["completion", "all"] = Field(
        "completion", description="sft: loss on the responses only (completion), or on every token of an example "
        "(all), as TRL does for a plain text field.",
    )
    sources: list[SourceConfig] = Field(
        default_factory=lambda: [SourceConfig(format="stdlib", max_bytes=4_000_000)], min_length=1,
        description="Where documents come from: entries with path or hf_name, format, field, weight.",
    )
    mix_by: Literal["tokens", "rows"] = Field(
        "tokens",
        description="Mixture weights count tokens (each sequence is drawn from one source) or rows (each document "
        "is drawn from a source, then packed).",
    )
    seq_len: int = Field(128, gt=0, description="Tokens per training sequence.")
    seed: int | None = Field(None, ge=0, lt=2**63,
                             description="Seeds the data order and mixture (0 to 2^63-1); default train.seed.")
    shuffle_buffer: int = Field(
        1024, ge=1, description="Documents are shuffled within consecutive windows of this many (1: no shuffle)."
    )
    reshuffle_on_resume: bool = Field(
        False, description="Each resume draws a new order over the documents not yet read in the current epoch "
        "(none repeated or left out), under a seed derived from data.seed and the position; a changed data.seed "
        "is then accepted at resume.",
    )
    doc_masking: bool = Field(False, description="Attention does not cross document boundaries inside a sequence.")
    on_bad_data: Literal["error", "skip"] = Field(
        "error", description="A malformed record stops the run with its file and line, or is skipped and counted."
    )
    audit: bool = Field(False, description="Append every global batch's sample fingerprints to samples.jsonl.")
    num_workers: int = Field(1, ge=0, description="Tokenizing worker processes per rank (0: in the training process).")
    tokenizer: ConfigPath | None = Field(
        None, description="HF tokenizer directory; empty: train a byte-level BPE on the sources and cache it."
    )
    vocab_size: int = Field(4096, ge=300, description="Vocabulary size of a tokenizer trained locally.")
    eval_fraction: float = Field(0.01, ge=0, lt=0.5, description="Share of each source's documents held out.")
    eval_split: Literal["spread", "tail"] = Field(
        "spread", description="Held-out documents spread over each whole source, or its last ones (`tail`: how runs "
        "began before this setting; their data positions resume only with it).",
    )
    eval_sources: list[SourceConfig] | None = Field(
        None, min_length=1, description="A separate held-out set, read whole by evaluation (entries as in sources); "
        "data.sources are then not split, and eval_fraction is not used.",
    )
    cache_dir: ConfigPath | None = Field(None, description="Tokenizer and index caches; default ~/.cache/clustertrain.")

    @property
    def packed_documents(self) -> bool:
        """Whether a row's documents must not see each other: doc masking, or SFT's examples."""
        return self.doc_masking or self.mode == "sft"
