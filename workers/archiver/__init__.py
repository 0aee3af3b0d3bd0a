"""The archiver: every event of the run, as Parquet on S3, for SQL audits.

One durable consumer per stream, one supervised task each (`process`): messages are classified
(event, poison, or something that did not answer), buffered, flushed by count and by time into one
Parquet file per event type and day (`rows`; keys from `schemas.archive.ArchiveKey`), and acked
only after the PUT (`stream`). Poison is archived as `undecodable` with its reason and dead-lettered;
what did not answer is retried, visibly (`waits`); anything else stops the process. Progress is per
message, read back from the archive on start (`progress`, which gives the argument that a SIGKILL
anywhere loses no row and writes none twice).
"""

from workers.archiver.process import ArchiveIncomplete, Archiver, drain_once, run_archiver
from workers.archiver.settings import ArchiverSettings, ArchiveSection

__all__ = ["ArchiveIncomplete", "ArchiveSection", "Archiver", "ArchiverSettings", "drain_once", "run_archiver"]
