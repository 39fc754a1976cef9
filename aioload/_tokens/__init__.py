"""Token sequences packed for language models: ``aioload.PackedTokens``.

``documents`` what a document of the source is and how it becomes token ids (text through a
tokenizer, or a column of token ids), fetched through the source's own read and decode;
``lengths`` each document's token count (given, a field of each document, or one index pass),
kept in a cache file; ``plan`` the packing: documents concatenated and cut into rows of
``seq_len + 1`` tokens, each row a list of ``(document, start, stop)`` spans, and window
mode's blocks of rows; ``rows`` a row's
tensors from its spans (inputs, labels that never cross a document, position ids, document
ids) and ``cu_seqlens`` for a batch; ``dataset`` the map-style dataset over rows.
"""
