"""The language front end: `.mk` text parsed (grammar.lark, syntax) and checked into the graph IR
(elaborate, consts, block_attrs, ir), with its element types (dtypes, quant) and diagnostics."""
