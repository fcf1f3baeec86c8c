"use strict";
// The admin JSON API: fetch helpers that turn OpenAI-shaped errors into exceptions with their message.

export const API = "/admin/api";

export class ApiError extends Error {
  constructor(message, status, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

async function request(method, path, body) {
  const init = { method, headers: { Accept: "application/json" } };
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
  const data = await response.json().catch(() => null);
  if (!response.ok) {
    const error = data && data.error;
    const message = (error && error.message) || (data && data.detail && JSON.stringify(data.detail))
      || `${method} ${path}: HTTP ${response.status}`;
    throw new ApiError(String(message), response.status, error && error.code);
  }
  return data;
}

export const getJson = (path) => request("GET", path);
export const postJson = (path, body = {}) => request("POST", path, body);

/** Path segment escaping for ids that come from the network. */
export const seg = (id) => encodeURIComponent(id);
