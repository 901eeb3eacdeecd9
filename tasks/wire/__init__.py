"""What crosses the wire between lanebench and a serving engine: request specs, stream events,
replies, and the KL gate's teacher-forced probes and scores. Below engines/ and client/, which both
speak it."""
