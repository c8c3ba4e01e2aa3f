// A tiny DOM builder: the panel is plain elements (buttons, tables, progress bars).
type Child = Node | string | null | undefined | false;

export function h(
  tag: string,
  attrs: Record<string, string | boolean | ((event: Event) => void)> = {},
  ...children: Child[]
): HTMLElement {
  const element = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (typeof value === 'function') {
      element.addEventListener(key.replace(/^on/, ''), value);
    } else if (value === true) {
      element.setAttribute(key, '');
    } else if (value !== false) {
      element.setAttribute(key, value);
    }
  }
  for (const child of children) {
    if (child !== null && child !== undefined && child !== false) {
      element.append(child);
    }
  }
  return element;
}
