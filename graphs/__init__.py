"""ggraph.graphs"""
