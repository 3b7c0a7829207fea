// MathJax 3 for pymdownx.arithmatex (generic mode): typeset only what arithmatex marked,
// \( \) inline and \[ \] display. Loaded before assets/mathjax/tex-chtml.js, which the
// build copies from the installed MathJax (tools/mkdocs/hooks.py): the site needs no CDN.
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: {
    ignoreHtmlClass: ".*|",
    processHtmlClass: "arithmatex",
  },
};
