"""The tables of a tuning database (SQLAlchemy 2 typed ORM).

The schema itself is created and upgraded only by the alembic migrations beside this file; these
classes must describe the newest migration's result.
"""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import Boolean, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.sql.functions import GenericFunction


def utcnow() -> str:
    """Timestamps are ISO-8601 strings in UTC: sortable, portable and readable in exports."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class json_extract(GenericFunction):  # noqa: N801 - SQL function names are lower case
    """``func.json_extract(text_column, "$.key")``: SQLite's function of that name, on every dialect.

    The JSON columns are text (one schema for every database); on PostgreSQL the text is cast to
    ``jsonb`` and the path is evaluated as an SQL/JSON path, the value returned as a number (shape
    values, the only use, are integers).
    """

    inherit_cache = True


@compiles(json_extract, "postgresql")
def _json_extract_postgresql(element, compiler, **kw):
    column, path = list(element.clauses)
    return (f"CAST(jsonb_path_query_first(CAST({compiler.process(column, **kw)} AS JSONB), "
            f"CAST({compiler.process(path, **kw)} AS JSONPATH)) #>> '{{}}' AS NUMERIC)")


class Base(DeclarativeBase):
    pass


class WorkloadRow(Base):
    """A workload: one of our operators at a shape and dtype, or a raw function by structural hash."""

    __tablename__ = "workloads"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(String, unique=True)
    op: Mapped[str] = mapped_column(String, index=True)  # "func" for a function without an operator
    shape_json: Mapped[str] = mapped_column(Text, default="{}")
    dtype: Mapped[str] = mapped_column(String, default="")
    attrs_json: Mapped[str] = mapped_column(Text, default="{}")
    structural_hash: Mapped[str] = mapped_column(String, index=True)
    func_json: Mapped[str | None] = mapped_column(Text, nullable=True)  # only for raw functions
    flops: Mapped[float] = mapped_column(Float, default=0.0)
    min_bytes: Mapped[float] = mapped_column(Float, default=0.0)
    created_at: Mapped[str] = mapped_column(String, default=utcnow)

    records: Mapped[list[RecordRow]] = relationship(back_populates="workload")


class TargetRow(Base):
    """A device and software stack. Records are reused between rows with the same ``match_key``."""

    __tablename__ = "targets"
    __table_args__ = (UniqueConstraint("match_key", "tvm_version", "driver_version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    match_key: Mapped[str] = mapped_column(String, index=True)
    kind: Mapped[str] = mapped_column(String)
    arch: Mapped[str] = mapped_column(String)
    device_name: Mapped[str] = mapped_column(String)
    num_cores: Mapped[int] = mapped_column(Integer)
    max_shared_memory: Mapped[int] = mapped_column(Integer, default=0)
    tvm_version: Mapped[str] = mapped_column(String)
    driver_version: Mapped[str] = mapped_column(String)

    records: Mapped[list[RecordRow]] = relationship(back_populates="target")


class RunRow(Base):
    """One tuning session (or one import), for provenance and history."""

    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    started_at: Mapped[str] = mapped_column(String, default=utcnow)
    finished_at: Mapped[str | None] = mapped_column(String, nullable=True)
    status: Mapped[str] = mapped_column(String, default="running")  # running|finished|interrupted|failed|imported
    host: Mapped[str] = mapped_column(String, default="")
    command: Mapped[str] = mapped_column(Text, default="")
    seed: Mapped[int | None] = mapped_column(Integer, nullable=True)
    autosched_version: Mapped[str] = mapped_column(String, default="")
    # The tuner's process on ``host`` (schema 0003): a run still "running" whose process is gone died
    # without finishing (kill -9, power loss) and is shown as stale.
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)

    records: Mapped[list[RecordRow]] = relationship(back_populates="run")


class RecordRow(Base):
    """One measured candidate: its point in a space and its timings, or why it failed."""

    __tablename__ = "records"
    __table_args__ = (Index("ix_records_lookup", "workload_id", "target_id", "median_us"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    uid: Mapped[str] = mapped_column(String(32), unique=True)  # stable across export/import
    workload_id: Mapped[int] = mapped_column(ForeignKey("workloads.id"))
    target_id: Mapped[int] = mapped_column(ForeignKey("targets.id"))
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id"), nullable=True)
    space: Mapped[str] = mapped_column(String)  # name@version
    point_json: Mapped[str] = mapped_column(Text)
    latencies_json: Mapped[str] = mapped_column(Text, default="[]")  # raw repeat times, seconds
    median_us: Mapped[float | None] = mapped_column(Float, nullable=True)  # None when failed
    error_kind: Mapped[str | None] = mapped_column(String, nullable=True)
    error_msg: Mapped[str | None] = mapped_column(Text, nullable=True)
    rel_error: Mapped[float | None] = mapped_column(Float, nullable=True)
    build_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    run_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    created_at: Mapped[str] = mapped_column(String, default=utcnow)
    # The share of the machine's CPU time other processes used while its batch was timed (schema 0003;
    # None where not measured: older records, remote runners).
    machine_load: Mapped[float | None] = mapped_column(Float, nullable=True)

    workload: Mapped[WorkloadRow] = relationship(back_populates="records")
    target: Mapped[TargetRow] = relationship(back_populates="records")
    run: Mapped[RunRow | None] = relationship(back_populates="records")
    validations: Mapped[list[ValidationRow]] = relationship(back_populates="record")


class ValidationRow(Base):
    """A record rebuilt and re-checked under another TVM version before it was applied (schema 0002).

    A record measured with one TVM version is not trusted under another until a validation row says
    it still builds and computes the right answer there.
    """

    __tablename__ = "validations"
    __table_args__ = (UniqueConstraint("record_id", "tvm_version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    record_id: Mapped[int] = mapped_column(ForeignKey("records.id"), index=True)
    tvm_version: Mapped[str] = mapped_column(String)
    ok: Mapped[bool] = mapped_column(Boolean)
    median_us: Mapped[float | None] = mapped_column(Float, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[str] = mapped_column(String, default=utcnow)

    record: Mapped[RecordRow] = relationship(back_populates="validations")
