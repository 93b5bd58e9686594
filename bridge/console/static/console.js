// rdq console: the pages work without this file; with it, the overview refreshes in place and a job's progress
// moves live. Shipped with the package; nothing is loaded from elsewhere.
"use strict";

function refreshInPlace(box) {
  const seconds = Number(box.dataset.refresh) || 5;
  setInterval(async () => {
    try {
      const response = await fetch(window.location.href, { credentials: "same-origin" });
      if (!response.ok) return;
      const page = new DOMParser().parseFromString(await response.text(), "text/html");
      const fresh = page.querySelector("[data-refresh]");
      if (fresh) box.innerHTML = fresh.innerHTML;  // the server's escaped HTML, as a full page load would show it
    } catch (e) { /* the next tick tries again */ }
  }, seconds * 1000);
}

function followJob(box) {
  const id = box.dataset.job;
  const tick = async () => {
    try {
      const response = await fetch(`/jobs/${encodeURIComponent(id)}.json`, { credentials: "same-origin" });
      if (!response.ok) return;
      const job = await response.json();
      document.getElementById("job-phase").textContent = job.phase;
      document.getElementById("job-done").textContent = job.done;
      document.getElementById("job-total").textContent = job.total;
      document.getElementById("job-rate").textContent = job.rate;
      document.getElementById("job-eta").textContent = job.eta_seconds === null ? "?" : job.eta_seconds;
      const rows = document.querySelector("#job-instances");
      for (const [name, p] of Object.entries(job.progress)) {
        let row = rows.querySelector(`tr[data-instance="${CSS.escape(name)}"]`);
        if (!row) {
          row = rows.insertRow();
          row.dataset.instance = name;
          for (let i = 0; i < 3; i++) row.insertCell();
          row.cells[0].textContent = name;
        }
        row.cells[1].textContent = p.done;
        row.cells[2].textContent = p.total;
      }
      // A new phase (the canary judged) or the end: the server renders what it has to say.
      if (!job.running || job.phase !== box.dataset.phase) window.location.reload();
    } catch (e) { /* the next tick tries again */ }
  };
  setInterval(tick, 1000);
}

document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("[data-refresh]").forEach(refreshInPlace);
  const job = document.querySelector("#job[data-running='1']");
  if (job) followJob(job);
});
