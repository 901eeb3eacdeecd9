"""A lane's live server: the endpoint, its process handle and the deadlines that name a dead or
late server. Below correctness/ and stages/, which both measure through it."""
