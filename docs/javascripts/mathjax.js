// MathJax 3 configuration, loaded before the site's own copy of tex-chtml.js (docs/hooks.py puts
// it at assets/mathjax). pymdownx.arithmatex (generic) wraps page math in .arithmatex elements
// with \( \) and \[ \] delimiters; notebook pages (mkdocs-jupyter) keep Jupyter's $ and $$, so
// those are processed too, inside the notebook's rendered markdown only.
window.MathJax = {
  loader: {
    // The bundle is served from the site itself: resolve its lazily loaded parts (TeX
    // extensions, fonts) relative to where tex-chtml.js was loaded from, never a CDN.
    paths: { mathjax: document.currentScript
      ? new URL("../assets/mathjax", document.currentScript.src).href
      : "/assets/mathjax" },
  },
  tex: {
    inlineMath: [["\\(", "\\)"], ["$", "$"]],
    displayMath: [["\\[", "\\]"], ["$$", "$$"]],
    processEscapes: true,
    processEnvironments: true,
    tags: "none",
  },
  options: {
    // Skip every element that has a class, unless it is one of processHtmlClass; an element
    // without a class inherits its parent's choice. So only arithmatex's spans and the rendered
    // markdown of notebook cells (whose <p>, <li>, <h2> carry no class) are searched for math;
    // ".*|" (which also matches the empty class) would skip the notebooks' paragraphs.
    ignoreHtmlClass: ".+",
    processHtmlClass: "arithmatex|jp-RenderedMarkdown|jp-MarkdownOutput|jp-RenderedHTMLCommon",
  },
  chtml: {
    fontURL: document.currentScript
      ? new URL("../assets/mathjax/output/chtml/fonts/woff-v2", document.currentScript.src).href
      : "/assets/mathjax/output/chtml/fonts/woff-v2",
  },
};

// The site does not use Material's instant navigation (navigation.instant): every page is a
// full load, and MathJax typesets it once at startup.
