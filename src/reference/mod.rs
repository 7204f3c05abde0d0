//! (module under construction: see DESIGN.md's module map)
