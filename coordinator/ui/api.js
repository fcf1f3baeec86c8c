"use strict";
// The admin JSON API: fetch helpers that turn OpenAI-shaped errors into exceptions with their message.
// Calls go with the session cookie (same origin); a 401 on any of them means the session has ended, and
// the handler set by setUnauthorizedHandler (the login screen) is told.

export const API = "/admin/api";

export class ApiError extends Error {
  constructor(message, status, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

let onUnauthorized = () => {};

/** fn(error) runs on a 401 from any call but those made with { quiet401: true } (whoami, login). */
export function setUnauthorizedHandler(fn) {
  onUnauthorized = fn;
}

async function request(method, path, body, { quiet401 = false } = {}) {
  const init = { method, headers: { Accept: "application/json" }, credentials: "same-origin" };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(`${API}${path}`, init);
  } catch (err) {
    throw new ApiError(`coordinator unreachable (${err.message})`, 0, "network");
  }
  const data = response.status === 204 ? null : await response.json().catch(() => null);
  if (!response.ok) {
    const error = data && data.error;
    const message = (error && error.message) || (data && data.detail && JSON.stringify(data.detail))
      || `${method} ${path}: HTTP ${response.status}`;
    const failure = new ApiError(String(message), response.status, error && error.code);
    if (response.status === 401 && !quiet401) onUnauthorized(failure);
    throw failure;
  }
  return data;
}

export const getJson = (path, options) => request("GET", path, undefined, options);
export const postJson = (path, body = {}, options) => request("POST", path, body, options);

/** Path segment escaping for ids that come from the network. */
export const seg = (id) => encodeURIComponent(id);
