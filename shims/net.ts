// pg asks net.isIP whether a host may be sent as TLS SNI; sockets come from edgepg, never from here.
const v4 = /^(25[0-5]|2[0-4]\d|1?\d?\d)(\.(25[0-5]|2[0-4]\d|1?\d?\d)){3}$/
export const isIPv4 = (s: string) => v4.test(s)
export const isIPv6 = (s: string) => s.includes(':') && /^[0-9a-f:.]+$/i.test(s)
export const isIP = (s: string) => (isIPv4(s) ? 4 : isIPv6(s) ? 6 : 0)
export class Socket {
  constructor() {
    throw new Error('edgepg: TCP sockets are not available here; connections go over WebSockets')
  }
}
export default { isIP, isIPv4, isIPv6, Socket }
