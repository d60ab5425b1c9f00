// pg uses util.deprecate (warnings for deprecated APIs) and util.types.isDate: the runtime's own
// where it has them (Node's warnings are 'warning' events), else these.
const native = (globalThis as any).process?.getBuiltinModule?.('util')
export const deprecate: <T extends (...args: any[]) => any>(fn: T, message: string) => T = native?.deprecate ?? warnOnce
function warnOnce<T extends (...args: any[]) => any>(fn: T, message: string): T {
  let warned = false
  return function (this: unknown, ...args: any[]) {
    if (!warned) {
      warned = true
      console.warn(`DeprecationWarning: ${message}`)
    }
    return fn.apply(this, args)
  } as T
}
export const isDate = (value: unknown): value is Date => Object.prototype.toString.call(value) === '[object Date]'
export const types = { isDate }
export const inspect = Object.assign((value: unknown) => String(value), { custom: Symbol.for('nodejs.util.inspect.custom') })
export default { deprecate, types, inspect }
