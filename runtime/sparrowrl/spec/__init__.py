"""What a job is and what is said about it, without torch: the job spec, the processes it runs,
its status, the bodies workers send, and the bounds on all of them. The CLI's base install and
the operator import this and nothing heavier."""
