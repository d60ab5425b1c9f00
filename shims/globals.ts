// Injected into the bundle for the globals pg expects: `process` (nextTick, env) and `Buffer`.
// Where the runtime has them (Node, Bun, Deno, workerd with nodejs_compat) the real ones are used.
import { Buffer as BufferPolyfill } from 'buffer'

const g = globalThis as any
export const Buffer: typeof BufferPolyfill = g.Buffer ?? BufferPolyfill
export const process = g.process?.nextTick
  ? g.process
  : {
      env: {},
      versions: {},
      platform: 'browser',
      nextTick: (fn: (...args: any[]) => void, ...args: any[]) => queueMicrotask(() => fn(...args)),
    }
