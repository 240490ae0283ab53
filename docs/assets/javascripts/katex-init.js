// Typeset the formulas that pymdownx.arithmatex (generic mode) marks: \( ... \) inline in
// span.arithmatex, \[ ... \] in div.arithmatex. KaTeX is served from the site itself
// (docs/assets/katex/, scripts/vendor_docs_assets.sh). document$ is Material's page
// observable: it also fires after an instant-navigation page change.
document$.subscribe(({ body }) => {
  body.querySelectorAll(".arithmatex").forEach((element) => {
    renderMathInElement(element, {
      delimiters: [
        { left: "\\(", right: "\\)", display: false },
        { left: "\\[", right: "\\]", display: true },
      ],
      throwOnError: false,
    });
  });
});
