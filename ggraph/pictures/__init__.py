"""Pictures and reports: graphs drawn as DOT/SVG with their memory plan (styles, layers, summaries,
error pictures) and the allocator's text report."""
