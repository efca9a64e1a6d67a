"""In-flight batching: the scheduler (waiting/running queues, chunked prefill, policies)."""
from kiln.plugins.inflight_batching.scheduler import (POLICIES, DraftPolicy, RequestRefused,
                                                 Scheduler, SchedulerConfig, SchedulerOutput,
                                                 TokenSequence, SequenceStatus, StepOutput)

__all__ = ["POLICIES", "DraftPolicy", "RequestRefused", "Scheduler", "SchedulerConfig",
           "SchedulerOutput", "TokenSequence", "SequenceStatus", "StepOutput"]
