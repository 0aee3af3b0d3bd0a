"""The archiver's settings: when to flush, and how long and how fast to retry what did not answer."""

from __future__ import annotations

from pydantic import Field, model_validator

from pipeline.config import MIB, Section, SprawlSettings
from pipeline.topology import ARCHIVER_MAX_ACK_PENDING


class ArchiveSection(Section):
    flush_events: int = Field(5000, ge=1)
    """Flush a stream's buffer once it holds this many events (above the consumer's max_ack_pending,
    ARCHIVER_MAX_ACK_PENDING, flushes happen by time only: unacked events stop deliveries)."""
    flush_interval_s: float = Field(5.0, gt=0)
    """... or once its oldest event has waited this long (the freshness of SQL queries) ..."""
    flush_bytes: int = Field(256 * MIB, ge=MIB)
    """... or once its events add up to this many encoded bytes: claim-checked events may each be up to
    `log.max_claim_bytes`, and a burst of them (forged or not) must not all wait in memory at once."""
    fetch_batch: int = Field(1000, ge=1, le=ARCHIVER_MAX_ACK_PENDING)
    """Messages fetched per pull; at most the archiver consumer's max_ack_pending
    (ARCHIVER_MAX_ACK_PENDING), since a pull may not ask for more than may be unacked."""
    retry_first_s: float = Field(0.5, gt=0)
    """First wait after a transient failure (the object store or the log did not answer); doubled
    after each further failure ..."""
    retry_max_s: float = Field(30.0, gt=0)
    """... up to this. Each retry logs the state and how long it has lasted."""
    give_up_after_s: float | None = Field(None, gt=0)
    """Exit (non-zero, for the supervisor to restart) once one transient state has lasted this long;
    None: wait out an outage of any length, visibly, acking nothing that is not written."""

    @model_validator(mode="after")
    def _first_within_max(self) -> ArchiveSection:
        if self.retry_first_s > self.retry_max_s:
            raise ValueError(f"retry_first_s ({self.retry_first_s}) is above retry_max_s ({self.retry_max_s})")
        return self


class ArchiverSettings(SprawlSettings):
    archive: ArchiveSection = ArchiveSection()
    """Flush and retry policy."""
