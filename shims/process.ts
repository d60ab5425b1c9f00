// Injected wherever the bundle uses the global `process` (pg reads env and calls nextTick): the
// runtime's own where it has one, otherwise just enough of it. Apart from Buffer's shim, so that
// code that needs only `process` (httpSql, through pg's defaults) does not bring in Buffer.
const g = globalThis as any
export const process = g.process?.nextTick
  ? g.process
  : {
      env: {},
      versions: {},
      platform: 'browser',
      nextTick: (fn: (...args: any[]) => void, ...args: any[]) => queueMicrotask(() => fn(...args)),
    }
