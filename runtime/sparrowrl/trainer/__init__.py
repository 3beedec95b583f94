"""The trainer process (`sparrowrl trainer`): the learner and its GRPO step, sharded ranks, the
control plane that workers call, what it records, and what it resumes from."""
