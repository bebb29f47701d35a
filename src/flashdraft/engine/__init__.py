"""The decode engine: one loop for one row or many (`decoder`), the KV cache, requests and sampling, the proposers
(DFlash, batched and as trees, prompt lookup), structured output and tools, and the cost-aware policy with its price
list and what it learns online."""
