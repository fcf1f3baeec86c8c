"use strict";
// Who is at the console. On load it asks /whoami: a 401 shows the login form instead of the dashboard,
// and so does any later 401 (the session ended). The header names the user and their role; a mesh run
// with --insecure has no users, and says so in a red banner.

import { getJson, postJson, setUnauthorizedHandler } from "./api.js";

const RETRY_MS = 3000;   // ask /whoami again this often while the coordinator cannot answer it

export class Auth {
  /**
   * elements: { panel, form, note, error, who, name, role, logout, banner }
   * onSignIn(user) starts the dashboard, onSignOut() stops it; onError(message) shows a toast.
   */
  constructor(elements, { onSignIn, onSignOut, onError }) {
    this.$ = elements;
    this.onSignIn = onSignIn;
    this.onSignOut = onSignOut;
    this.onError = onError;
    this.user = null;
    this.state = "pending";   // pending | out | in
    this.retry = 0;
  }

  start() {
    setUnauthorizedHandler(() => this.expired());
    this.$.form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.submit();
    });
    this.$.logout.addEventListener("click", () => this.logout());
    return this.check();
  }

  /** GET /whoami: in on 200, the form on 401; anything else (down, restarting) is asked again shortly. */
  async check() {
    clearTimeout(this.retry);
    try {
      const { user } = await getJson("/whoami", { quiet401: true });
      this.signIn(user);
    } catch (err) {
      if (err.status === 401) {
        if (this.state !== "out") this.showForm();
        this.setNote("");
        return;
      }
      if (this.state !== "out") this.showForm();
      this.setNote(`The coordinator does not answer (${err.message}); trying again…`);
      this.retry = setTimeout(() => { if (this.state === "out") this.check(); }, RETRY_MS);
    }
  }

  async submit() {
    const form = this.$.form;
    const button = form.querySelector("button[type=submit]");
    const username = form.elements.username.value.trim();
    const password = form.elements.password.value;
    this.showError("");
    button.disabled = true;
    try {
      const { user } = await postJson("/login", { username, password }, { quiet401: true });
      form.elements.password.value = "";
      this.signIn(user);
    } catch (err) {
      if (err.code === "insecure_mode") {   // nothing to log in to: whoami lets everyone in
        await this.check();
        return;
      }
      this.showError(err.code === "invalid_login" ? "Wrong username or password." : err.message);
      form.elements.password.value = "";
      form.elements.password.focus();
    } finally {
      button.disabled = false;
    }
  }

  signIn(user) {
    clearTimeout(this.retry);
    if (this.state === "in") return;
    this.user = user;
    this.state = "in";
    const body = document.body;
    body.dataset.auth = "in";
    body.dataset.role = user.role;
    this.$.panel.hidden = true;
    // Insecure mode's "user" is the mode itself: the banner names it in full, the header briefly.
    this.$.name.textContent = user.kind === "insecure" ? "no login" : user.name;
    this.$.name.title = user.kind === "key" ? `${user.name}: signed in with an API key` : user.name;
    this.$.role.textContent = user.role;
    this.$.role.className = `badge role role-${user.role === "operator" ? "operator" : "viewer"}`;
    this.$.role.title = user.role === "operator" ? "may deploy, re-plan and drain" : "may look, not act";
    this.$.logout.hidden = user.kind !== "user";     // an API key or insecure mode has no session to end
    this.$.banner.hidden = user.kind !== "insecure";
    this.$.who.hidden = false;
    this.onSignIn(user);
  }

  /** A call got a 401: the session expired or was revoked. */
  expired() {
    if (this.state !== "in") return;
    this.signOut("Your session has ended: log in again.");
  }

  async logout() {
    try {
      await postJson("/logout", {}, { quiet401: true });
    } catch (err) {
      if (err.status === 0) {       // the cookie is still set: staying signed in is the honest answer
        this.onError(`Log out failed: ${err.message}`);
        return;
      }
    }
    if (this.state === "in") this.signOut("You have logged out.");
  }

  signOut(note) {
    this.user = null;
    this.onSignOut();
    this.showForm();
    this.setNote(note);
  }

  showForm() {
    this.state = "out";
    const body = document.body;
    body.dataset.auth = "out";
    delete body.dataset.role;
    this.$.who.hidden = true;
    this.$.banner.hidden = true;
    this.$.panel.hidden = false;
    this.showError("");
    const { username, password } = this.$.form.elements;
    (username.value ? password : username).focus();
  }

  setNote(text) {
    this.$.note.textContent = text;
    this.$.note.hidden = !text;
  }

  showError(text) {
    this.$.error.textContent = text;
    this.$.error.hidden = !text;
  }
}
